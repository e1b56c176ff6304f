"""`python3 -m memtrack.control`: the directory holding memtrack_control.h and
memtrack_control.py (for `cc -I"$(python3 -m memtrack.control)"` or PYTHONPATH)."""

from pathlib import Path

print(Path(__file__).resolve().parent)
