/* Allocator probes: entry uprobes and return uretprobes of every allocator family,
 * paired per thread, reported once per outer call.
 *
 * Three programs serve every allocator function of every family: `mt_alloc` at the
 * entry of allocating functions, `mt_ret` at their return, `mt_free` at the entry of
 * frees. Each probe carries an attach cookie (bpf_get_attach_cookie) that says what
 * the function is: the event kind, the allocator family, and which integer argument
 * holds the size, its multiplier, the old pointer, the out-pointer and the flags
 * (memtrack.capture.allocators.Shape builds it; the MT_CK_* layout below). One copy
 * of the stack capture is compiled and verified, and userspace attaches all of a
 * module's functions with one uprobe_multi link per program.
 *
 * Needs: MT_EVENTS_PAGES (events ring size in pages). Optional: MT_STACKS (stacks.h
 * is included before this file and defines mt_stack_capture), MT_PYFRAMES (pyframes.h
 * too: mt_py_capture folds the Python frames into the stack hash; MT_PY_CUT 1 cuts the
 * native stack at them). */

#include <uapi/linux/ptrace.h>

#ifndef MT_EVENTS_PAGES
#define MT_EVENTS_PAGES 4096
#endif

/* Internal kinds beyond enum mt_kind: resolved at return. */
#define MT_K_POSIX_MEMALIGN 100 /* the address is written to the out-pointer */
#define MT_K_MALLOCX 101        /* jemalloc flags decide: aligned / zeroed / plain */

/* Attach cookie layout (memtrack.capture.allocators.cookie): the kind in bits 0-7, the
 * allocator in bits 8-15, then 2-bit argument selectors (0: none, 1-3: the first,
 * second, third integer argument): the size, the size's multiplier (none: 1), the old
 * pointer (a free's: the pointer it frees; CPython's _PyObject_Free takes it second),
 * the out-pointer, the flags. */
#define MT_CK_ALLOCATOR 8
#define MT_CK_SIZE 16
#define MT_CK_MUL 18
#define MT_CK_OLD 20
#define MT_CK_OUTP 22
#define MT_CK_FLAGS 24
#define MT_CK_WRAPPABLE 26 /* 1 bit: an unprobed wrapper may call this (mt_unwrap) */

/* Loss counters of the capture core (userspace sums the per-CPU slots). */
#define MT_L_EVENTS_RING_FULL 0
#define MT_L_ATTACH_DROPPED 1
#define MT_L_UNPAIRED_RETURN 2
BPF_PERCPU_ARRAY(mt_core_losses, u64, 4);

BPF_RINGBUF_OUTPUT(mt_events, MT_EVENTS_PAGES);

/* Call sites of unprobed allocator wrappers (memtrack.capture.wrappers), keyed by the
 * return address in a process (an address's meaning is the same in every process that
 * maps the module there; entries of processes gone age out): the wrapper's family, CFA
 * - rsp at the return address, the bytes from the wrapper's start to it, and the
 * callee-saved registers it pushed (DWARF number, offset from the CFA). */
struct mt_wrap {
    u8 family;
    u8 nsaved;
    u16 cfa;
    u32 delta;
    u8 reg[2];
    u16 _pad;
    s16 off[2];
};
BPF_TABLE("lru_hash", u64, struct mt_wrap, mt_wrap_sites, 65536);

#define MT_UNWRAP_DEPTH 3 /* nothrow new -> new -> malloc */
BPF_PERCPU_ARRAY(mt_frames, struct mt_frame, 1); /* the current entry's (the BPF stack is full) */

/* Follow the return addresses at sp through registered wrapper call sites: f is left
 * at the outermost wrapper's entry (levels 0: none called us). ra0: the return address
 * at the entry's sp when the caller has read it already, else 0. */
static __always_inline void mt_unwrap(struct pt_regs *ctx, struct mt_frame *f, u64 ra0) {
    u64 sp = PT_REGS_SP(ctx);
#pragma unroll
    for (int i = 0; i < MT_UNWRAP_DEPTH; i++) {
        u64 ra = ra0;
        if ((i > 0 || !ra) && bpf_probe_read_user(&ra, sizeof(ra), (void *)sp))
            break;
        struct mt_wrap *w = mt_wrap_sites.lookup(&ra);
        if (!w)
            break;
        u64 cfa = sp + 8 + w->cfa;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            u32 n = f->nsaved;
            if (j >= w->nsaved || n >= MT_UNWRAP_SAVED)
                break;
            u64 v = 0;
            bpf_probe_read_user(&v, sizeof(v), (void *)(cfa + w->off[j]));
            f->val[n & (MT_UNWRAP_SAVED - 1)] = v;
            f->reg[n & (MT_UNWRAP_SAVED - 1)] = w->reg[j];
            f->nsaved = n + 1;
        }
        sp = cfa - 8;
        f->ip = ra - w->delta;
        f->family = w->family;
        f->levels = i + 1;
    }
    f->sp = sp;
}

static __always_inline void mt_loss(int idx) {
    u64 *v = mt_core_losses.lookup(&idx);
    if (v)
        (*v)++;
}

static __always_inline void mt_emit(u32 pid, u32 tid, u8 kind, u8 allocator, u64 flags,
                                    u64 addr, u64 old_addr, u64 size, u64 stack_hash) {
    mt_backpressure(MT_RING_EVENTS);
    struct mt_event *e = mt_events.ringbuf_reserve(sizeof(struct mt_event));
    if (!e) {
        mt_loss(MT_L_EVENTS_RING_FULL);
        return;
    }
    mt_fill_event(e, pid, tid, kind, allocator, flags, addr, old_addr, size, stack_hash);
    /* no wakeup: the session polls the ring every few milliseconds, and a wakeup
     * (irq_work) would cost more than the rest of the record */
    mt_events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
}

/* Remember the return-address slot a uretprobe is about to hijack (common.h); only
 * stack copies need them, so only with MT_STACKS. Returns the return address the slot
 * held (0: unreadable). */
static __always_inline u64 mt_retslot_push(struct mt_retslots *r, u64 sp) {
    u32 d = r->depth;
    u64 value = 0;
    /* A tail call re-enters with the same sp: its slot already holds the trampoline,
     * keep the original value recorded by the outer entry. */
    if (d > 0 && d - 1 < MT_MAX_NEST && r->slot[(d - 1) & (MT_MAX_NEST - 1)] == sp)
        value = r->value[(d - 1) & (MT_MAX_NEST - 1)];
    else
        bpf_probe_read_user(&value, sizeof(value), (void *)sp);
    if (d < MT_MAX_NEST) {
        r->slot[d & (MT_MAX_NEST - 1)] = sp;
        r->value[d & (MT_MAX_NEST - 1)] = value;
    }
    r->depth = d + 1;
    return value;
}

static __always_inline int mt_wrapping(void) {
    int k = MT_CONFIG_WRAPPED;
    u64 *v = mt_config.lookup(&k);
    return v && *v;
}

static __always_inline int mt_enter(struct pt_regs *ctx, u8 kind, u8 allocator, u64 size,
                                    u64 old_addr, u64 outp, u64 flags, u64 wrappable) {
    u64 pt = bpf_get_current_pid_tgid();
    u32 pid = pt >> 32, tid = (u32)pt;
    struct mt_thread *t = mt_thread_of(pid, tid, 1);
    if (!t)
        return 0;
    struct mt_call *c = &t->call;
    u64 ra = 0;
#ifdef MT_STACKS
    ra = mt_retslot_push(&t->rs, PT_REGS_SP(ctx));
#endif
    u32 d = c->depth;
    c->depth = d + 1;
    c->last_free_ptr = 0;
    if (d != 0)
        return 0;
    int zero = 0;
    struct mt_frame *f = mt_frames.lookup(&zero);
    if (!f)
        return 0;
    f->sp = PT_REGS_SP(ctx);
    f->ip = PT_REGS_IP(ctx);
    f->levels = 0;
    f->nsaved = 0;
    if (wrappable && mt_wrapping()) {
        mt_unwrap(ctx, f, ra);
        if (f->levels)
            allocator = f->family;
    }
    c->kind = kind;
    c->allocator = allocator;
    c->size = size;
    c->old_addr = old_addr;
    c->outp = outp;
    c->flags = flags;
    c->stack_hash = 0;
    c->on = mt_is_enabled();
#ifdef MT_STACKS
    if (c->on) {
#ifdef MT_PYFRAMES
        /* MT_PY_CUT (--python-stacks python): Python code running on the thread stands
         * for the native frames under it (stacks.h, a Python cut) */
        if (mt_py_frame(pid, tid) && MT_PY_CUT)
            c->stack_hash = mt_stack_pycut(ctx, pid, tid, f);
        else
            c->stack_hash = mt_stack_capture(ctx, pid, tid, f);
        c->stack_hash = mt_py_capture(pid, tid, c->stack_hash);
#else
        c->stack_hash = mt_stack_capture(ctx, pid, tid, f);
#endif
    }
#endif
    return 0;
}

int mt_ret(struct pt_regs *ctx) {
    u64 pt = bpf_get_current_pid_tgid();
    u32 pid = pt >> 32, tid = (u32)pt;
    struct mt_thread *t = mt_thread_of(pid, tid, 0);
    if (!t || t->call.depth == 0) {
        if (mt_is_tracked(pid))
            mt_loss(MT_L_UNPAIRED_RETURN);
        return 0;
    }
    struct mt_call *c = &t->call;
#ifdef MT_STACKS
    if (t->rs.depth > 0)
        t->rs.depth -= 1;
#endif
    c->depth -= 1;
    if (c->depth != 0 || !c->on)
        return 0;
    u64 ret = PT_REGS_RC(ctx);
    u8 kind = c->kind;
    u64 addr = ret;
    if (kind == MT_K_POSIX_MEMALIGN) {
        if ((u32)ret != 0)
            return 0;
        addr = 0;
        bpf_probe_read_user(&addr, sizeof(addr), (void *)c->outp);
        kind = MT_ALIGNED_ALLOC;
    } else if (kind == MT_K_MALLOCX) {
        /* MALLOCX_LG_ALIGN in the low 6 bits, MALLOCX_ZERO = 0x40 */
        kind = (c->flags & 0x3f) ? MT_ALIGNED_ALLOC : (c->flags & 0x40) ? MT_CALLOC : MT_MALLOC;
    }
    if (addr == 0) {
        /* realloc(p, 0) freed p and returned NULL; any other NULL is a failure */
        if (kind == MT_REALLOC && c->size == 0 && c->old_addr != 0)
            mt_emit(pid, tid, MT_FREE, c->allocator, 0, c->old_addr, 0, 0, 0);
        return 0;
    }
    mt_emit(pid, tid, kind, c->allocator, 0, addr, c->old_addr, c->size, c->stack_hash);
    return 0;
}

static __always_inline int mt_free_enter(struct pt_regs *ctx, u8 allocator, u64 ptr, u64 size) {
    u64 pt = bpf_get_current_pid_tgid();
    u32 pid = pt >> 32, tid = (u32)pt;
    if (ptr == 0)
        return 0;
    struct mt_thread *t = mt_thread_of(pid, tid, 1);
    if (!t || t->call.depth != 0)
        return 0;
    struct mt_call *c = &t->call;
    u64 sp = PT_REGS_SP(ctx);
    /* operator delete -> free (tail or nested call) passes the same pointer on a stack
     * at or below the outer one with no allocation in between: report it once. */
    if (c->last_free_ptr == ptr && sp <= c->last_free_sp && sp + 512 >= c->last_free_sp)
        return 0;
    c->last_free_ptr = ptr;
    c->last_free_sp = sp;
    if (!mt_is_enabled())
        return 0;
    mt_emit(pid, tid, MT_FREE, allocator, 0, ptr, 0, size, 0);
    return 0;
}


/* The argument a 2-bit selector of the cookie names (0: none = `none`). Read from a
 * small table on the stack rather than through branches, so that the verifier walks
 * the stack capture after it once, not once per combination of selectors. */
static __always_inline u64 mt_arg(u64 *args, u64 cookie, int shift) {
    return args[(cookie >> shift) & 3];
}

int mt_alloc(struct pt_regs *ctx) {
    u64 ck = bpf_get_attach_cookie(ctx);
    u64 args[4] = {0, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx)};
    u64 size = mt_arg(args, ck, MT_CK_SIZE);
    args[0] = 1;
    size *= mt_arg(args, ck, MT_CK_MUL);
    args[0] = 0;
    return mt_enter(ctx, ck & 0xff, (ck >> MT_CK_ALLOCATOR) & 0xff, size,
                    mt_arg(args, ck, MT_CK_OLD), mt_arg(args, ck, MT_CK_OUTP),
                    mt_arg(args, ck, MT_CK_FLAGS), (ck >> MT_CK_WRAPPABLE) & 1);
}

int mt_free(struct pt_regs *ctx) {
    u64 ck = bpf_get_attach_cookie(ctx);
    u64 args[4] = {0, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx)};
    return mt_free_enter(ctx, (ck >> MT_CK_ALLOCATOR) & 0xff, mt_arg(args, ck, MT_CK_OLD),
                         mt_arg(args, ck, MT_CK_SIZE));
}
