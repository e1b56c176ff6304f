"""Where a runtime address lies, for the unwinder and the symbolizer alike (blazesym's
normalize beside symbolize): the module files of a run by build id (modules.py), a
runtime address normalized to its module and ELF virtual address (normalize.py), and
the address space a forked child inherits at its fork (mappings.py)."""
