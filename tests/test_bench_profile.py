"""The profile's charging of sampled frames to packages: a pure function of py-spy's names."""

from __future__ import annotations

import pytest

from bench.profile import charge, fold

SITE = "/venv/lib/python3.11/site-packages"


@pytest.mark.parametrize(
    ("path", "charged"),
    [
        # The SDK's trace package is not the standard library's trace module.
        (f"{SITE}/opentelemetry/sdk/trace/__init__.py", ("opentelemetry.sdk", "")),
        (f"{SITE}/opentelemetry/trace/__init__.py", ("opentelemetry.trace", "")),
        ("/usr/lib/python3.11/trace.py", ("stdlib", "")),
        ("/usr/lib/python3.11/threading.py", ("stdlib", "")),
        ("<frozen importlib._bootstrap>", ("stdlib", "")),
        (f"{SITE}/requests/sessions.py", ("requests", "")),
        ("src/gevent/_hub_primitives.py", ("gevent", "")),
        ("/home/me/fanout/service/rpc/handler.py", ("service", "service/rpc/handler.py")),
        ("/home/me/src/fanout/lookups/http.py", ("lookups", "lookups/http.py")),
        (f"{SITE}/lookups/mongo.py", ("lookups", "lookups/mongo.py")),
        ("<string>", ("generated", "")),
    ],
)
def test_a_frame_is_charged_to_the_package_its_file_was_imported_from(
    path: str, charged: tuple[str, str]
) -> None:
    assert charge(path) == charged


def test_self_time_goes_to_the_innermost_frame() -> None:
    raw = "\n".join(
        [
            f"serve (/srv/service/rpc/handler.py:10);send ({SITE}/requests/api.py:5) 3",
            "serve (/srv/service/rpc/handler.py:10) 1",
        ]
    )
    folded = fold(raw)
    assert folded["samples"] == 4
    assert folded["by_package"] == {"requests": 0.75, "service": 0.25}
    assert folded["by_own_module"] == {"service/rpc/handler.py": 0.25}
