/* Shared by every memtrack BPF source: the event record and the tracked-pid set.
 * struct mt_event must match memtrack.schema.EVENT_DTYPE byte for byte (64 bytes):
 * the events ring holds only these, so userspace reads a span of it as one numpy
 * array. */
#ifndef MEMTRACK_COMMON_H
#define MEMTRACK_COMMON_H

enum mt_kind {
    MT_MALLOC = 1, MT_CALLOC = 2, MT_REALLOC = 3, MT_ALIGNED_ALLOC = 4, MT_FREE = 5,
    MT_MMAP = 6, MT_MUNMAP = 7, MT_BRK = 8, MT_FORK = 9, MT_EXEC = 10, MT_EXIT = 11,
    MT_REGION = 14,
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

static __always_inline void mt_fill_event(struct mt_event *e, u32 pid, u32 tid, u8 kind,
                                          u8 allocator, u64 flags, u64 addr, u64 old_addr,
                                          u64 size, u64 stack_hash) {
    e->ts = bpf_ktime_get_ns();
    e->pid = pid;
    e->tid = tid;
    e->kind = kind;
    e->allocator = allocator;
    e->_pad = 0;
    e->_pad2 = 0;
    e->flags = flags;
    e->addr = addr;
    e->old_addr = old_addr;
    e->size = size;
    e->stack_hash = stack_hash;
}

/* MT_LOOP(i, n) { body } MT_LOOP_END: body for i = 0 .. n-1 (n a constant), leaving
 * early with break. The verifier walks a bounded loop once per iteration (a 4096-word
 * stack loop alone was 150 k of the 766 k instructions it processed for mt_alloc, most
 * of a capture's start-up); with MT_ITER (Linux 6.7+ with BTF: memtrack.capture.program
 * decides) the loop runs on the kernel's open-coded number iterator, whose body the
 * verifier walks until its states converge, a few times whatever n is. It converges
 * only when nothing the body carries over from one iteration to the next is a value
 * the verifier must know exactly (an index, an offset): such values live in scratch
 * memory and are read back each iteration, and i itself is only ever masked.
 * The calls are placeholders that memtrack.capture.program turns into kfunc calls
 * (bcc cannot declare kernel functions). */
#ifdef MT_ITER
struct mt_iter {
    u64 opaque;
} __attribute__((aligned(8)));
static long (*mt_iter_new)(struct mt_iter *it, int start, int end) = (void *)MT_KF_ITER_NEW;
static int *(*mt_iter_next)(struct mt_iter *it) = (void *)MT_KF_ITER_NEXT;
static void (*mt_iter_destroy)(struct mt_iter *it) = (void *)MT_KF_ITER_DESTROY;
#define MT_LOOP(i, n)                                                                       \
    {                                                                                       \
        struct mt_iter mt_it_;                                                              \
        int *mt_ip_;                                                                        \
        mt_iter_new(&mt_it_, 0, (n));                                                       \
        while ((mt_ip_ = mt_iter_next(&mt_it_))) {                                          \
            u32 i = *mt_ip_;                                                                \
            if (i >= (u32)(n))                                                              \
                break;
#define MT_LOOP_END                                                                         \
        }                                                                                   \
        mt_iter_destroy(&mt_it_);                                                           \
    }
#else
#define MT_LOOP(i, n)                                                                       \
    {                                                                                       \
        _Pragma("clang loop unroll(disable)") for (u32 i = 0; i < (u32)(n); i++) {
#define MT_LOOP_END                                                                         \
        }                                                                                   \
    }
#endif

/* Processes (tgids) being tracked: the capture core adds the root pid before it
 * resumes it and every child at fork, and removes them at exit. Every part filters
 * its events with mt_is_tracked(). */
BPF_HASH(mt_tracked, u32, u8, 65536);

/* mt_config[0]: 1 while recording is enabled (--start-disabled and the control FIFO
 * switch it); parts emit nothing while it is 0. mt_config[1]: 1 when allocator probes
 * are scoped to each traced process (lifecycle.c mt_new_process). mt_config[2]: 1 once
 * a wrapper's call site is registered (alloc.c mt_wrap_sites). mt_config[3]: the
 * session's generation (mt_threads). */
BPF_ARRAY(mt_config, u64, 4);
#define MT_CONFIG_WRAPPED 2

/* Where an allocation's stack starts: the probed function's entry (levels 0), or the
 * entry of the outermost of the unprobed allocator wrappers that called it (alloc.c
 * mt_unwrap): sp above their frames, ip at its start, and the callee-saved registers
 * they had pushed, read back from the stack (reg: DWARF number). */
#define MT_UNWRAP_SAVED 4
struct mt_frame {
    u64 sp;
    u64 ip;
    u32 levels;
    u32 nsaved;
    u64 val[MT_UNWRAP_SAVED];
    u8 reg[MT_UNWRAP_SAVED];
    u32 family;
};

static __always_inline int mt_is_tracked(u32 tgid) {
    return mt_tracked.lookup(&tgid) != 0;
}

/* Backpressure (--on-ring-full pause): a producer that finds a ring's unconsumed data
 * at or above its high watermark is stopped (SIGSTOP to the writing thread, which stops
 * its process; mt_paused holds the pids stopped and since when) and its current record
 * is still written; the session's drain resumes it once the rings are below their low
 * watermark. Every ring write calls mt_backpressure(its MT_RING_* id) first. The
 * session puts each ring in mt_rings (bcc 0.26 has no ring.ringbuf_query(): an array of
 * maps gives the helper the map) and its high watermark in bytes in mt_pause_at (0:
 * --on-ring-full drop). */
#define MT_SIGSTOP 19
#define MT_RING_EVENTS 0
#define MT_RING_STACKS 1
#define MT_RING_RSS 2
#define MT_RING_RSS_EVENTS 3
#define MT_RING_FAULTS 4
#define MT_RING_PYFRAMES 5
#define MT_NRINGS 8
BPF_RINGBUF_OUTPUT(mt_ring_template, 1);
BPF_ARRAY_OF_MAPS(mt_rings, "mt_ring_template", MT_NRINGS);
BPF_ARRAY(mt_pause_at, u64, MT_NRINGS);
BPF_HASH(mt_paused, u32, u64, 65536);
BPF_PERCPU_ARRAY(mt_pauses, u64, MT_NRINGS); /* pauses per ring */

static __always_inline void mt_backpressure(int ring) {
    u64 *at = mt_pause_at.lookup(&ring);
    if (!at || !*at)
        return;
    void *rb = mt_rings.lookup(&ring);
    if (!rb || bpf_ringbuf_query(rb, BPF_RB_AVAIL_DATA) < *at)
        return;
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    if (!mt_is_tracked(pid))
        return;
    /* mt_paused keeps the first stop (when; and the pause is counted once), but every
     * producer that runs while the ring is above its watermark stops again: a SIGCONT
     * sent meanwhile (by anyone: a shell's `bg`, a supervisor, the drain's resume racing
     * with a thread still in flight) cancels a pending stop, and a second SIGSTOP to a
     * process stopping already changes nothing.
     * The stop goes to the calling thread, not to its process: a process-wide SIGSTOP
     * already pending is not queued again and wakes no thread, so while the thread
     * that sent the first one was preempted before its return to user mode (where the
     * group stop begins), the other threads of its process wrote on, every send a
     * no-op, until the ring was full (the likely cause of 4 events lost in CI: a
     * one-page ring, 4 threads on 2 CPUs). A thread's own SIGSTOP stops it at its next
     * return to user mode and from there every thread of its process, as a
     * process-wide one does. */
    u64 now = bpf_ktime_get_ns();
    int first = mt_paused.insert(&pid, &now) == 0;
    if (bpf_send_signal_thread(MT_SIGSTOP)) {
        /* an exiting task cannot be stopped: let another of its threads try */
        if (first)
            mt_paused.delete(&pid);
        return;
    }
    u64 *n = first ? mt_pauses.lookup(&ring) : 0;
    if (n)
        (*n)++;
}

static __always_inline int mt_is_enabled(void) {
    int k = 0;
    u64 *v = mt_config.lookup(&k);
    return v && *v;
}

/* Per-thread allocator call state (alloc.c): nesting depth and the outer call's
 * arguments. */
struct mt_call {
    u32 depth;
    u8 kind;
    u8 allocator;
    u8 on;          /* recording was enabled at the outer entry */
    u8 _pad;
    u64 size;
    u64 old_addr;
    u64 outp;
    u64 flags;
    u64 stack_hash;
    u64 last_free_ptr; /* tail-called / nested free of the same pointer: report once */
    u64 last_free_sp;
};

/* Return-address slots hijacked by live uretprobes on this thread, innermost last.
 * The allocator probes push (slot = sp at entry, value = the return address there)
 * at each probed entry that has a uretprobe, and pop at its return; a stack copy
 * taken while depth > 0 records them so that decoding can put the real return
 * addresses back in place of the uprobe trampoline's. */
#define MT_MAX_NEST 4
struct mt_retslots {
    u32 depth;
    u32 _pad;
    u64 slot[MT_MAX_NEST];
    u64 value[MT_MAX_NEST];
};

/* A traced thread's state: its allocator call, its hijacked return slots, and its
 * stack's end as stacks.h last read it from mt_stack_ends (0: not read yet).
 *
 * One slot per thread in a direct-mapped array indexed by the tid's low bits: the
 * verifier inlines an array lookup (~1 ns) where a hash lookup costs ~50 ns, and the
 * probes of one malloc/free pair looked this state up seven times. A slot belongs to
 * `owner` = the session's generation << 32 | tid; a thread claims a free one (never
 * used, given back, or an earlier session's) by compare-and-swap at its first
 * allocator call, and gives it back at exit and exec (lifecycle.c). A thread whose
 * slot another live thread holds (their tids share the low bits) has its state in
 * mt_threads_spill. The end of a session bumps the generation (mt_config[3]), which
 * frees every slot at once; userspace empties the spill. */
struct mt_thread {
    struct mt_call call; /* first: a pointer to it is one to the state */
    struct mt_retslots rs;
    u64 stack_end;
    u64 owner;
};
#ifndef MT_THREAD_SLOTS
#define MT_THREAD_SLOTS 16384 /* a power of two */
#endif
#define MT_CONFIG_GENERATION 3
BPF_ARRAY(mt_threads, struct mt_thread, MT_THREAD_SLOTS);
BPF_HASH(mt_threads_spill, u32, struct mt_thread, 4096);
BPF_PERCPU_ARRAY(mt_thread_blank, struct mt_thread, 1); /* a spill entry's template */

static __always_inline u64 mt_owner(u32 tid) {
    int k = MT_CONFIG_GENERATION;
    u64 *g = mt_config.lookup(&k);
    return ((g ? *g : 0) << 32) | tid;
}

/* The calling thread's state, or 0. With `create`, a thread of a tracked process
 * without state gets it (zeroed); a thread with state is tracked, which saves the
 * mt_tracked lookup on the hot path. */
static __always_inline struct mt_thread *mt_thread_of(u32 pid, u32 tid, int create) {
    u64 me = mt_owner(tid);
    u32 idx = tid & (MT_THREAD_SLOTS - 1);
    struct mt_thread *t = mt_threads.lookup(&idx);
    if (!t)
        return 0;
    u64 old = t->owner;
    if (old == me)
        return t;
    struct mt_thread *s = mt_threads_spill.lookup(&tid);
    if (s && s->owner == me)
        return s;
    if (!create || !mt_is_tracked(pid))
        return 0;
    if ((old == 0 || (old >> 32) != (me >> 32)) &&
        __sync_val_compare_and_swap(&t->owner, old, me) == old) {
        __builtin_memset(&t->call, 0, sizeof(t->call));
        __builtin_memset(&t->rs, 0, sizeof(t->rs));
        t->stack_end = 0;
        return t;
    }
    int zero = 0;
    struct mt_thread *b = mt_thread_blank.lookup(&zero);
    if (!b)
        return 0;
    b->owner = me;
    mt_threads_spill.update(&tid, b);
    return mt_threads_spill.lookup(&tid);
}

/* A thread's state goes back (at its exit, at exec). */
static __always_inline void mt_thread_release(u32 tid) {
    u64 me = mt_owner(tid);
    u32 idx = tid & (MT_THREAD_SLOTS - 1);
    struct mt_thread *t = mt_threads.lookup(&idx);
    if (t && t->owner == me)
        t->owner = 0;
    mt_threads_spill.delete(&tid);
}

#endif
