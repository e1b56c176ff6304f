"""What a traced program links to or imports to talk to memtrack: memtrack_control.h
(C, C++, anything with a C FFI) and memtrack_control.py (Python). Both depend on
nothing but the C library / the standard library: vendor either file into a
benchmark's tree, or take it from here (`python -m memtrack.control` prints where)."""
