"""Pytest plugins shared by the test modules: real servers and backends on 127.0.0.1."""
