"""Running configurations: fresh stacks of processes (``stack.py``, ``processes.py``,
``ready.py``), the scenarios and their plan (``scenarios.py``), and the runner."""
