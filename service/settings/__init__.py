"""Settings: loading TOML, ``FANOUT_*`` variables and flags (``config.py``), each key
declared once with its type, default and help (``declarations.py``), the ``[server]``
section (``server.py``), the cores this process may use (``cores.py``), and the
warnings a loaded configuration may still earn (``checks.py``). The other
sections are declared by the parts that own them and composed here."""
