"""DWARF as memtrack reads it: line tables and inline chains for symbolization
(memtrack.dwarf.lines), call frame information as compact unwind tables
(memtrack.dwarf.cfi), the expression evaluator the rare CFI rules need
(memtrack.dwarf.expr), and the LEB128 decoder they share (memtrack.dwarf.leb128)."""
