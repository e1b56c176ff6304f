/* Shared by every memtrack BPF source: the event record and the tracked-pid set.
 * struct mt_event must match memtrack.schema.EVENT_DTYPE byte for byte (64 bytes):
 * the events ring holds only these, so userspace reads a span of it as one numpy
 * array. */
#ifndef MEMTRACK_COMMON_H
#define MEMTRACK_COMMON_H

enum mt_kind {
    MT_MALLOC = 1, MT_CALLOC = 2, MT_REALLOC = 3, MT_ALIGNED_ALLOC = 4, MT_FREE = 5,
    MT_MMAP = 6, MT_MUNMAP = 7, MT_BRK = 8, MT_FORK = 9, MT_EXEC = 10, MT_EXIT = 11,
};

enum mt_allocator {
    MT_A_NONE = 0, MT_A_LIBC = 1, MT_A_CXX = 2, MT_A_JEMALLOC = 3, MT_A_MIMALLOC = 4,
    MT_A_TCMALLOC = 5, MT_A_SYSCALL = 6, MT_A_OTHER = 7,
};

struct mt_event {
    u64 ts;
    u32 pid;
    u32 tid;
    u8 kind;
    u8 allocator;
    u16 _pad;
    u32 _pad2;
    u64 flags;
    u64 addr;
    u64 old_addr;
    u64 size;
    u64 stack_hash;
};

#endif
