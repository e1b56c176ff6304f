/* Allocation stacks: copy the user stack at allocator entry, reduce the copy to its
 * skeleton, hash the skeleton, and emit one stack record per distinct skeleton on the
 * mt_stack_ring ring buffer.
 *
 * The skeleton is what can steer offline unwinding: the words of the copy (and the
 * registers) whose value lies in a kept region of the address space — a 64 KiB region
 * holding executable code of a tracked process (return addresses, code pointers) or a
 * thread stack (saved frame pointers, pointers into frames) — at their positions; every
 * other word (locals, heap pointers, counters) reads as 0. `process` unwinds the skeleton,
 * never the raw bytes, so two copies with one skeleton unwind to the same frames by
 * construction, whatever their locals hold: repeated calls from one place share a record.
 * Of the registers only rbx, rbp, rsp, r12-r15 and rip can be in a skeleton (the others
 * are dead at an allocator's entry). The hash also covers sp (kept values are
 * absolute), the copy length and whether the budget cut the copy, and for a cut copy
 * the kernel's frame-pointer chain (the part of the stack beyond the copy that
 * `process` may use).
 *
 * A Python cut (mt_stack_pycut; pyframes.h, MT_PY_CUT: the thread runs Python code): the
 * copy is the return address alone, rip the only register kept and sp hashed as 0, so
 * the record names the allocator and its caller and nothing that depends on where the
 * stack lies; the Python frames stand for the rest (one record per Python call path).
 *
 * Included after common.h. memtrack.capture.stacks.StacksPart supplies the sizes:
 *   MT_STACK_BUDGET      bytes copied from sp upward at most (multiple of 512)
 *   MT_STACK_WORDS       a power of two >= MT_STACK_BUDGET / 8
 *   MT_STACK_OUT_WORDS   a power of two >= the largest record (words)
 *   MT_STACK_RING_PAGES  pages of the record ring
 *   MT_STACK_SEEN        entries of the dedupe LRU set
 *   MT_STACK_THREADS     entries of the per-thread stack-end map
 *   MT_NCPU              possible CPUs (scratch slots)
 *   MT_STACK_COPIES      defined: every capture emits a record that also carries its raw
 *                        copy (a debug mode: the proof that skeletons are exact)
 *
 * Kept regions (mt_stack_regions, one byte per 64 KiB region, the address's bits 16..37:
 * aliases 256 GiB apart share a byte, which only keeps more words): userspace marks every
 * executable mapping and the main stack at each attach stop (StacksPart.on_stop); the
 * capture marks the regions around its own sp; mprotect/mmap with PROT_EXEC mark theirs.
 * Regions are never unmarked, so a region executable at any time is kept from then on.
 *
 * Copy length: a thread's stack ends at mt_stack_ends[tid] (the main thread: its initial
 * sp, argc's slot, set at exec; a thread: the top of the stack clone3/clone gave it; else
 * learned from the first read that faults); the thread's state (common.h mt_thread)
 * keeps what it read there. Reads are page by page (one read per page). Below a known
 * end a page that faults is one not in memory, read as zeros: a frame's locals never
 * touched (a 16 KiB buffer), and the copy goes on past it (a faulting read costs
 * ~0.5 us; stack_pages_absent counts them).
 *
 * Record layout (little-endian u64 words; memtrack.schema.stackrecord describes it):
 *   0 hash   1 ts   2 pid | tid << 32   3 sp
 *   4 copy_len | fp_count << 32 | nfix << 48 | flags << 56 (1 cut, 4 skeleton, 8 new,
 *     16 raw copy attached)
 *   5 reg_kept (bit r: register r is in the skeleton)   6 body_len (bytes)
 *   fp_count return addresses (bpf_get_stack, user frame pointers; cut copies only)
 *   nfix (slot, original value) pairs: uretprobe trampolines replaced in the copy
 *   body: regs[17] (raw), kept bitmap (one word per 64 words of the copy, padding
 *         included), the kept words in order; with MT_STACK_COPIES the raw copy after.
 *
 * Hash (FNV-1a steps h = (h ^ x) * P): word i of the copy, zero-padded to whole groups
 * of 64, masked to 0 unless kept, into lane i % 2 (lane l seeded offset ^ l); the lanes
 * folded in order into offset; then the 8 registers that may be kept (rbx, rbp, rsp,
 * r12-r15, rip in DWARF order) masked the same way, sp, copy_len | cut << 32, and for a
 * cut copy each frame-pointer entry then their count; 0 means "no stack" and becomes 1.
 *
 * The loops are MT_LOOP (common.h: the kernel's number iterator where it has one), and
 * the program is written for the verifier to walk each loop body few times:
 * - loops leave through data-dependent breaks; what they leave behind is stored to
 *   scratch and read back through a volatile pointer, which leaves one verifier state
 *   to carry on with instead of one per exit;
 * - per word everything is branch-free (a region byte is 0 or 1: its negation masks);
 * - big buffers are u8 arrays cast to u64: bcc describes every element of a u64 array
 *   member to userspace, which made a 4 MiB map take a minute to load.
 * The hot path (a stack already seen) is the copy and one pass of about ten
 * instructions per word that hashes the word and leaves its kept flag beside it;
 * building a record (once per distinct skeleton) packs the flagged words in a second
 * pass, so that the record is what was hashed whatever the region map became since. */
#ifndef MEMTRACK_STACKS_H
#define MEMTRACK_STACKS_H

#include <uapi/linux/ptrace.h>

#define MT_FNV_OFFSET 0xcbf29ce484222325ULL
#define MT_FNV_PRIME 0x100000001b3ULL
#define MT_PAGE 4096
#define MT_GROUP 64 /* words per kept-bitmap word; the copy is zero-padded to whole groups */
#define MT_STEP 16  /* words per iteration of the hash loop (unrolled) */
#define MT_PACK 8   /* words per iteration of the record's packing loop (unrolled) */
#define MT_NREGS 17
#define MT_FP_DEPTH 127 /* the most bpf_get_stack gives (kernel.perf_event_max_stack) */
#define MT_HDR_WORDS 7
#define MT_SW_MASK (MT_STACK_WORDS - 1)
#define MT_KOFF (MT_STACK_WORDS + MT_PAGE / 8) /* words from a copy word to its flag */
#define MT_OW_MASK (MT_STACK_OUT_WORDS - 1)
#define MT_REGION_SHIFT 16
#define MT_REGION_BYTES (1 << 22)
#define MT_REGION_MASK (MT_REGION_BYTES - 1)
#define MT_STACK_SANE (1ULL << 30) /* a stack end farther than this above sp is not sp's */
/* The registers a stack's unwinding can depend on: rbx, rbp, rsp, r12-r15, rip. At an
 * allocator's entry the caller-saved ones hold nothing the caller's frames need (its
 * CFA is rsp + 8), so they are never in the skeleton. */
#define MT_CALLEE_SAVED ((1 << 3) | (1 << 6) | (1 << 7) | (0xf << 12) | (1 << 16))

#define MT_SF_CUT 1
#define MT_SF_SKELETON 4
#define MT_SF_NEW 8
#define MT_SF_COPY 16
#define MT_SF_PYCUT 32

/* mt_stack_stats indexes (per CPU; StacksPart sums them). */
enum mt_stack_stat {
    MT_SS_COPY_FAILED = 0, MT_SS_CUT = 1, MT_SS_DEDUPE_FULL = 2, MT_SS_RING_FULL = 3,
    MT_SS_RECORDS = 4, MT_SS_DEDUPED = 5, MT_SS_CAPTURES = 6, MT_SS_END_LEARNED = 7,
    MT_SS_PAGE_ABSENT = 8, MT_SS_NSTATS = 9,
};

struct mt_stack_scratch {
    /* the copy, with a page of slack (reads and padding stay inside at masked offsets),
     * then one flag word per copy word (its low byte: kept or not) */
    u8 words[(MT_KOFF + MT_STACK_WORDS + MT_GROUP) * 8];
    u8 out[2 * MT_STACK_OUT_WORDS * 8];
    u64 regs[MT_NREGS];
    u64 fix[2 * MT_MAX_NEST];
    u64 lane[2];
    u64 nwords;
    u64 cut;
    u64 nfix;
    u64 nfp;
    u64 regkept;
    u64 pos;
    u64 pos2;
    u64 fault;
    u64 bitmap; /* mt_stack_pack: where the kept bitmap goes */
};

struct mt_stack_regions {
    u8 kept[MT_REGION_BYTES];
};

BPF_ARRAY(mt_stack_scratch, struct mt_stack_scratch, MT_NCPU);
BPF_F_TABLE("array", int, struct mt_stack_regions, mt_stack_regions, 1, BPF_F_MMAPABLE);
BPF_TABLE("lru_hash", u64, u8, mt_stack_seen, MT_STACK_SEEN);
BPF_TABLE("lru_hash", u32, u64, mt_stack_ends, MT_STACK_THREADS);
BPF_HASH(mt_stack_clones, u32, u64, 4096); /* parent tid -> the child's stack top */
BPF_HASH(mt_stack_execmaps, u32, u64, 4096); /* tid -> length of its PROT_EXEC mmap */
BPF_PERCPU_ARRAY(mt_stack_stats, u64, MT_SS_NSTATS);
BPF_RINGBUF_OUTPUT(mt_stack_ring, MT_STACK_RING_PAGES);

#define MT_W(s) ((u64 *)(s)->words)
#define MT_O(s) ((u64 *)(s)->out)

static __always_inline void mt_stack_count(int idx) {
    u64 *v = mt_stack_stats.lookup(&idx);
    if (v)
        *v += 1;
}

/* 1 when x != 0, without a branch the verifier would have to follow both ways. */
static __always_inline u64 mt_nz(u64 x) {
    u64 t = x | -x;
    asm volatile("" : "+r"(t));
    return t >> 63;
}

/* 1 when a < b for a, b < 2^62, branch-free. */
static __always_inline u64 mt_lt(u64 a, u64 b) {
    u64 t = a - b;
    asm volatile("" : "+r"(t));
    return t >> 63;
}

static __always_inline u64 mt_fnv_step(u64 h, u64 w) {
    return (h ^ w) * MT_FNV_PRIME;
}

static __always_inline struct mt_stack_regions *mt_regions(void) {
    int zero = 0;
    return mt_stack_regions.lookup(&zero);
}

/* 0 or 1 (the only values a region byte takes): whether v lies in a kept region. */
static __always_inline u64 mt_kept(const u8 *kept, u64 v) {
    return kept[(v >> MT_REGION_SHIFT) & MT_REGION_MASK];
}

/* Mark the regions of [lo, hi) kept (a range of more than 256 regions, 16 MiB, keeps its
 * first 256). */
static __always_inline void mt_mark(u8 *kept, u64 lo, u64 hi) {
    u64 r = lo >> MT_REGION_SHIFT;
    u64 last = (hi - 1) >> MT_REGION_SHIFT;
    MT_LOOP(i, 256)
        if (r + i > last)
            break;
        u64 idx = (r + i) & MT_REGION_MASK;
        asm volatile("" : "+r"(idx)); /* clang would fold the mask into a strided pointer */
        kept[idx] = 1;
    MT_LOOP_END
}

/* Copy [sp, min(sp + budget, stack end)) page by page. A thread without a known end
 * reads until a page faults, and remembers that page as its end (mt_stack_ends and its
 * state). Leaves the word count (0: no copy) and whether the budget cut the copy in s. */
static __always_inline void mt_stack_copy(struct mt_stack_scratch *s, u64 sp, u32 pid,
                                          u32 tid) {
    u64 *W = MT_W(s);
    struct mt_thread *t = mt_thread_of(pid, tid, 0);
    if (!t) {
        s->nwords = 0;
        return;
    }
    u64 end = t->stack_end;
    if (!end) {
        u64 *endp = mt_stack_ends.lookup(&tid);
        end = endp ? *endp : 0;
        t->stack_end = end;
    }
    u64 known = end > sp && end - sp < MT_STACK_SANE;
    u64 limit = MT_STACK_BUDGET;
    if (known && end - sp < limit)
        limit = (end - sp) & ~7ULL;
    volatile struct mt_stack_scratch *vs = s;
    u64 first = MT_PAGE - (sp & (MT_PAGE - 1));
    if (first > limit)
        first = limit;
    /* the bytes copied so far and whether a page faulted, in scratch: the loop's exits
     * leave one verifier state to carry on with */
    vs->pos = 0;
    vs->fault = 1;
    if (bpf_probe_read_user(W, first, (void *)sp) == 0) {
        vs->pos = first;
        vs->fault = 0;
        /* bounded: a few pages, and an iterator step costs a kfunc call at each run */
#pragma clang loop unroll(disable)
        for (int k = 0; k < MT_STACK_BUDGET / MT_PAGE + 1; k++) {
            u64 at = vs->pos;
            if (at >= limit)
                break;
            u64 sz = limit - at;
            if (sz > MT_PAGE)
                sz = MT_PAGE;
            if (bpf_probe_read_user(&W[(at / 8) & MT_SW_MASK], sz, (void *)(sp + at))) {
                /* below the known end, a page not in memory: never touched (a big
                 * frame's unused locals; swapped out pages are the rare other case)
                 * reads as the zeros the helper left, and the copy goes on */
                if (!known) {
                    vs->fault = 1;
                    break;
                }
                mt_stack_count(MT_SS_PAGE_ABSENT);
            }
            vs->pos = at + sz;
        }
    }
    u64 got = vs->pos, fault = vs->fault;
    u64 cut = 0;
    if (known) {
        cut = !fault && end - sp > MT_STACK_BUDGET;
    } else if (got && !fault) {
        /* the budget was reached: does the stack go on? */
        u64 probe = 0;
        if (bpf_probe_read_user(&probe, sizeof(probe), (void *)(sp + got)))
            end = sp + got;
        else
            cut = 1;
    } else if (got) {
        end = sp + got;
    }
    s->nwords = got / 8;
    s->cut = cut;
    if (!known && end) {
        mt_stack_ends.update(&tid, &end);
        t->stack_end = end;
        mt_stack_count(MT_SS_END_LEARNED);
    }
}

/* Put back the return addresses that live uretprobes replaced with their trampoline
 * (common.h mt_retslots) and list the restored slots in s->fix; branch-free per slot.
 * Leaves the count in s->nfix. */
static __always_inline void mt_stack_fixups(struct mt_stack_scratch *s, struct mt_retslots *rs,
                                            u64 sp, u64 n) {
    u64 *W = MT_W(s);
    u64 nfix = 0;
    u64 depth = rs->depth;
#pragma unroll
    for (int i = 0; i < MT_MAX_NEST; i++) {
        u64 off = rs->slot[i] - sp;
        u64 idx = (off / 8) & MT_SW_MASK;
        u64 ok = mt_lt(i, depth) & (1 - mt_nz(off & 7)) & mt_lt(off / 8, n) &
                 mt_lt(off, 1ULL << 32);
        u64 m = 0 - ok;
        u64 old = W[idx];
        W[idx] = (rs->value[i] & m) | (old & ~m);
        s->fix[(2 * nfix) & (2 * MT_MAX_NEST - 1)] = rs->slot[i];
        s->fix[(2 * nfix + 1) & (2 * MT_MAX_NEST - 1)] = rs->value[i];
        nfix += ok;
    }
    s->nfix = nfix;
}

/* Keeps clang from hoisting a whole group's loads above the hash steps: it spilled
 * them all to the 512-byte BPF stack. */
#define MT_BARRIER() asm volatile("" ::: "memory")

/* One word into lane h; its kept flag beside it for the record. */
#define MT_MIX(J, h)                                                                        \
    {                                                                                       \
        u64 w_ = wp[J];                                                                     \
        u64 k_ = mt_kept(kept, w_);                                                         \
        *(u8 *)&wp[(J) + MT_KOFF] = k_;                                                     \
        h = mt_fnv_step(h, w_ & (0 - k_));                                                  \
        MT_BARRIER();                                                                       \
    }

/* The four lanes over the copy's kept words (whole groups, zero-padded), left in
 * s->lane; each word's kept flag is left beside it. */
static __always_inline void mt_stack_lanes(struct mt_stack_scratch *s, const u8 *kept, u64 n) {
    volatile u64 *lane = s->lane;
    lane[0] = MT_FNV_OFFSET;
    lane[1] = MT_FNV_OFFSET ^ 1;
    u64 h0 = lane[0], h1 = lane[1];
    u64 *W = MT_W(s);
    u64 padded = (n + MT_GROUP - 1) & ~(u64)(MT_GROUP - 1);
    MT_LOOP(g, MT_STACK_WORDS / MT_GROUP)
        if ((u64)g * MT_GROUP >= padded)
            break;
        /* a bounded inner loop: one iterator step (a kfunc call) per group */
#pragma clang loop unroll(disable)
        for (int q = 0; q < MT_GROUP / MT_STEP; q++) {
            u64 *wp = &W[(g * MT_GROUP + q * MT_STEP) & MT_SW_MASK];
#pragma unroll
            for (int j = 0; j < MT_STEP; j += 2) {
                MT_MIX(j, h0)
                MT_MIX(j + 1, h1)
            }
        }
    MT_LOOP_END
    lane[0] = h0;
    lane[1] = h1;
}

/* Registers in DWARF order. */
static __always_inline void mt_stack_regs(struct mt_stack_scratch *s, struct pt_regs *ctx) {
    u64 *r = s->regs;
    r[0] = ctx->ax; r[1] = ctx->dx; r[2] = ctx->cx; r[3] = ctx->bx;
    r[4] = ctx->si; r[5] = ctx->di; r[6] = ctx->bp; r[7] = ctx->sp;
    r[8] = ctx->r8; r[9] = ctx->r9; r[10] = ctx->r10; r[11] = ctx->r11;
    r[12] = ctx->r12; r[13] = ctx->r13; r[14] = ctx->r14; r[15] = ctx->r15;
    r[16] = ctx->ip;
}

/* The registers of the frame `f` (the probed function's entry, or its wrappers'). */
static __always_inline void mt_stack_frame_regs(struct mt_stack_scratch *s, struct pt_regs *ctx,
                                                struct mt_frame *f) {
    mt_stack_regs(s, ctx);
    if (f->levels) {
        s->regs[7] = f->sp;
        s->regs[16] = f->ip;
#pragma unroll
        for (int i = 0; i < MT_UNWRAP_SAVED; i++)
            if (i < f->nsaved)
                s->regs[f->reg[i] & 15] = f->val[i];
    }
}

/* The hash from the lanes in s: they, the kept registers (their mask left in
 * s->regkept), sp, the copy length and cut flag, and a cut copy's frame-pointer chain
 * (s->nfp entries in the record being built). Everything comes from scratch: the
 * branches taken before leave no register the verifier would tell apart. */
static __always_inline u64 mt_stack_fold(struct mt_stack_scratch *s, const u8 *kept, u64 sp) {
    volatile struct mt_stack_scratch *vs = s;
    u64 n = vs->nwords, cut = vs->cut;
    volatile u64 *lane = s->lane;
    u64 h = MT_FNV_OFFSET;
    h = mt_fnv_step(h, lane[0]);
    h = mt_fnv_step(h, lane[1]);
    u64 regkept = 0;
#pragma unroll
    for (int r = 0; r < MT_NREGS; r++) {
        if (!((MT_CALLEE_SAVED >> r) & 1))
            continue;
        u64 v = s->regs[r];
        u64 k = mt_kept(kept, v);
        h = mt_fnv_step(h, v & (0 - k));
        regkept |= k << r;
    }
    s->regkept = regkept;
    h = mt_fnv_step(h, sp);
    h = mt_fnv_step(h, (n * 8) | (cut << 32));
    if (cut) {
        u64 nfp = vs->nfp;
        u64 *fp = &MT_O(s)[MT_HDR_WORDS];
        MT_LOOP(i, MT_FP_DEPTH)
            if (i >= nfp)
                break;
            h = mt_fnv_step(h, fp[i]);
        MT_LOOP_END
        h = mt_fnv_step(h, nfp);
    }
    return h ? h : 1;
}

/* The record's body from s->out[pos]: raw registers, the kept bitmap and the kept words
 * (the flags the hash pass left); returns the position after it. */
static __always_inline u64 mt_stack_pack(struct mt_stack_scratch *s, u64 n, u64 pos) {
    volatile struct mt_stack_scratch *vs = s;
    u64 *O = MT_O(s);
    u64 *W = MT_W(s);
#pragma unroll
    for (int r = 0; r < MT_NREGS; r++)
        O[(pos + r) & MT_OW_MASK] = s->regs[r];
    u64 ngroups = (n + MT_GROUP - 1) / MT_GROUP;
    /* the bitmap's position and the next word's, in scratch (MT_LOOP) */
    vs->bitmap = pos + MT_NREGS;
    vs->pos2 = pos + MT_NREGS + ngroups;
    MT_LOOP(g, MT_STACK_WORDS / MT_GROUP)
        if ((u64)g * MT_GROUP >= n)
            break;
        u64 *wp = &W[(g * MT_GROUP) & MT_SW_MASK];
        u64 bits = 0;
        u64 p = vs->pos2;
        /* a bounded inner loop: one iterator step per group, not per word */
#pragma clang loop unroll(disable)
        for (int q = 0; q < MT_GROUP / MT_PACK; q++) {
            u64 *qp = &wp[q * MT_PACK];
#pragma unroll
            for (int j = 0; j < MT_PACK; j++) {
                u64 k = *(u8 *)&qp[j + MT_KOFF];
                O[p & MT_OW_MASK] = qp[j];
                p += k;
                bits |= k << (q * MT_PACK + j);
                MT_BARRIER();
            }
        }
        vs->pos2 = p;
        O[(vs->bitmap + g) & MT_OW_MASK] = bits;
    MT_LOOP_END
    return vs->pos2;
}

/* Capture the calling thread's stack from the frame `f` (common.h: the probed
 * function's entry, or its wrappers'); the thread has state (common.h mt_thread_of).
 * Returns the stack's hash (0: no stack). Emits a stack record when the hash was not
 * seen before. */
static __always_inline u64 mt_stack_capture(struct pt_regs *ctx, u32 pid, u32 tid,
                                            struct mt_frame *f) {
    int cpu = bpf_get_smp_processor_id();
    struct mt_stack_scratch *s = mt_stack_scratch.lookup(&cpu);
    struct mt_stack_regions *rg = mt_regions();
    if (!s || !rg)
        return 0;
    volatile struct mt_stack_scratch *vs = s;
    u8 *kept = rg->kept;
    mt_stack_count(MT_SS_CAPTURES);
    u64 sp = f->sp;
    mt_stack_copy(s, sp, pid, tid);
    u64 n = vs->nwords;
    if (n == 0 || n > MT_STACK_WORDS) {
        mt_stack_count(MT_SS_COPY_FAILED);
        return 0;
    }
    u64 *W = MT_W(s);
    /* zero-pad the last group */
#pragma unroll
    for (int j = 0; j < MT_GROUP; j++)
        W[n + j] = 0;
    struct mt_thread *t = mt_thread_of(pid, tid, 0);
    if (!t)
        return 0;
    mt_stack_fixups(s, &t->rs, sp, n);
    /* this stack's own regions: the one below sp's, sp's, and the copy end's (a copy
     * spans two regions at most) */
    kept[((sp >> MT_REGION_SHIFT) - 1) & MT_REGION_MASK] = 1;
    kept[(sp >> MT_REGION_SHIFT) & MT_REGION_MASK] = 1;
    kept[((sp + n * 8 - 1) >> MT_REGION_SHIFT) & MT_REGION_MASK] = 1;
    mt_stack_frame_regs(s, ctx, f);
    vs->nfp = 0;
    if (vs->cut) {
        mt_stack_count(MT_SS_CUT);
        long got = bpf_get_stack(ctx, &MT_O(s)[MT_HDR_WORDS], MT_FP_DEPTH * 8,
                                 BPF_F_USER_STACK);
        vs->nfp = got > 0 ? (u64)got / 8 : 0;
        /* the chain starts at the live ip; the wrappers keep rbp, so the rest holds */
        if (got > 0 && f->levels)
            MT_O(s)[MT_HDR_WORDS] = f->ip;
    }
    n = vs->nwords;
    if (n > MT_STACK_WORDS)
        return 0;
    mt_stack_lanes(s, kept, n);
    u64 h = mt_stack_fold(s, kept, sp);
#ifndef MT_STACK_COPIES
    if (mt_stack_seen.lookup(&h)) {
        mt_stack_count(MT_SS_DEDUPED);
        return h;
    }
#endif

    /* A record: header, fp chain, fixups, body. */
    u64 *O = MT_O(s);
    if (vs->nfp > MT_FP_DEPTH)
        vs->nfp = MT_FP_DEPTH;
    if (vs->nfix > MT_MAX_NEST)
        vs->nfix = MT_MAX_NEST;
    u64 pos = MT_HDR_WORDS + vs->nfp;
#pragma unroll
    for (int i = 0; i < 2 * MT_MAX_NEST; i++)
        O[(pos + i) & MT_OW_MASK] = s->fix[i];
    vs->pos = pos + 2 * vs->nfix;
    n = vs->nwords;
    if (n > MT_STACK_WORDS)
        return h;
    vs->pos2 = mt_stack_pack(s, n, vs->pos);
    /* one verifier state from here on, whatever the path */
    n = vs->nwords;
    pos = vs->pos2;
    u64 nfp = vs->nfp & 255, nfix = vs->nfix & (2 * MT_MAX_NEST - 1);
    u64 flags = MT_SF_SKELETON | (vs->cut ? MT_SF_CUT : 0);
#ifdef MT_STACK_COPIES
    u64 is_new = mt_stack_seen.lookup(&h) == 0;
    if (n > MT_STACK_WORDS)
        return h;
    bpf_probe_read_kernel(&O[pos & MT_OW_MASK], n * 8, W);
    pos += n;
    flags |= MT_SF_COPY | (is_new ? MT_SF_NEW : 0);
#else
    u64 is_new = 1;
    flags |= MT_SF_NEW;
#endif
    u64 body = vs->pos;
    O[0] = h;
    O[1] = bpf_ktime_get_ns();
    O[2] = pid | ((u64)tid << 32);
    O[3] = sp;
    O[4] = (n * 8) | (nfp << 32) | (nfix << 48) | (flags << 56);
    O[5] = vs->regkept;
    O[6] = (pos - body) * 8;
    u64 len = pos * 8;
    if (len > 2 * MT_STACK_OUT_WORDS * 8)
        len = 2 * MT_STACK_OUT_WORDS * 8;
    mt_backpressure(MT_RING_STACKS);
    if (mt_stack_ring.ringbuf_output((void *)O, len, BPF_RB_NO_WAKEUP)) {
        mt_stack_count(MT_SS_RING_FULL);
        return h;
    }
    mt_stack_count(MT_SS_RECORDS);
    if (is_new) {
        u8 one = 1;
        if (mt_stack_seen.update(&h, &one))
            mt_stack_count(MT_SS_DEDUPE_FULL);
    }
    return h;
}

/* A Python cut of the calling thread's stack from the frame `f` (above): its hash, the
 * skeleton hash of a one-word copy in closed form (a zero word's step multiplies by
 * the prime): lane 0 the return address then 31 zero words, lane 1 32 zero words, the
 * registers 0 but rip, sp 0, copy length 8. Emits its record when the hash is new. */
static __always_inline u64 mt_stack_pycut(struct pt_regs *ctx, u32 pid, u32 tid,
                                          struct mt_frame *f) {
    int cpu = bpf_get_smp_processor_id();
    struct mt_stack_scratch *s = mt_stack_scratch.lookup(&cpu);
    struct mt_stack_regions *rg = mt_regions();
    if (!s || !rg)
        return 0;
    u8 *kept = rg->kept;
    mt_stack_count(MT_SS_CAPTURES);
    u64 sp = f->sp;
    u64 *W = MT_W(s);
    struct mt_thread *t = mt_thread_of(pid, tid, 0);
    if (!t || bpf_probe_read_user(W, 8, (void *)sp)) {
        mt_stack_count(MT_SS_COPY_FAILED);
        return 0;
    }
    mt_stack_fixups(s, &t->rs, sp, 1);
    mt_stack_frame_regs(s, ctx, f);
    u64 ra = W[0], rip = s->regs[16];
    u64 kra = mt_kept(kept, ra), krip = mt_kept(kept, rip);
    u64 p31 = 1;
#pragma unroll
    for (int i = 0; i < 31; i++)
        p31 *= MT_FNV_PRIME;
    u64 lane0 = mt_fnv_step(MT_FNV_OFFSET, ra & (0 - kra)) * p31;
    u64 lane1 = (MT_FNV_OFFSET ^ 1) * p31 * MT_FNV_PRIME;
    u64 h = mt_fnv_step(mt_fnv_step(MT_FNV_OFFSET, lane0), lane1);
#pragma unroll
    for (int r = 0; r < 7; r++) /* rbx, rbp, rsp, r12-r15: not kept */
        h = mt_fnv_step(h, 0);
    h = mt_fnv_step(h, rip & (0 - krip));
    h = mt_fnv_step(h, 0);  /* sp */
    h = mt_fnv_step(h, 8);  /* copy length 8, not cut */
    h = h ? h : 1;
#ifndef MT_STACK_COPIES
    if (mt_stack_seen.lookup(&h)) {
        mt_stack_count(MT_SS_DEDUPED);
        return h;
    }
    u64 is_new = 1;
#else
    u64 is_new = mt_stack_seen.lookup(&h) == 0;
#endif
    /* the record is emitted as mt_stack_capture's is, written out again: one function
     * for both joined their verifier states (over the million instructions it allows) */
    u64 *O = MT_O(s);
    u64 nfix = s->nfix != 0; /* one slot: a tail call's entries name it twice */
    O[MT_HDR_WORDS] = s->fix[0];
    O[MT_HDR_WORDS + 1] = s->fix[1];
    u64 body = MT_HDR_WORDS + 2 * nfix;
#pragma unroll
    for (int r = 0; r < MT_NREGS; r++)
        O[(body + r) & MT_OW_MASK] = s->regs[r];
    u64 pos = body + MT_NREGS;
    O[pos & MT_OW_MASK] = kra;
    O[(pos + 1) & MT_OW_MASK] = ra;
    pos += 1 + kra;
    u64 flags = MT_SF_SKELETON | MT_SF_PYCUT | (is_new ? MT_SF_NEW : 0);
#ifdef MT_STACK_COPIES
    O[pos & MT_OW_MASK] = W[0];
    pos += 1;
    flags |= MT_SF_COPY;
#endif
    O[0] = h;
    O[1] = bpf_ktime_get_ns();
    O[2] = pid | ((u64)tid << 32);
    O[3] = sp;
    O[4] = 8 | (nfix << 48) | (flags << 56);
    O[5] = krip << 16;
    O[6] = (pos - body) * 8;
    u64 len = pos * 8;
    if (len > 2 * MT_STACK_OUT_WORDS * 8)
        len = 2 * MT_STACK_OUT_WORDS * 8;
    mt_backpressure(MT_RING_STACKS);
    if (mt_stack_ring.ringbuf_output((void *)O, len, BPF_RB_NO_WAKEUP)) {
        mt_stack_count(MT_SS_RING_FULL);
        return h;
    }
    mt_stack_count(MT_SS_RECORDS);
    if (is_new) {
        u8 one = 1;
        if (mt_stack_seen.update(&h, &one))
            mt_stack_count(MT_SS_DEDUPE_FULL);
    }
    return h;
}

/* Syscall tracepoints as laid out in tracefs (stable): StacksPart.attach attaches the
 * programs below by name (lifecycle.c owns the TRACEPOINT_PROBE names). */
struct mt_sys_enter_tp {
    u64 common;
    s32 nr;
    u32 pad;
    u64 a[6];
};
struct mt_sys_exit_tp {
    u64 common;
    s32 nr;
    u32 pad;
    s64 ret;
};

/* Thread stacks: clone3/clone with CLONE_VM give the child a stack whose top is the
 * child's stack end; a fork child runs on a copy of its parent's stack: the parent
 * thread's end. */
#define MT_CLONE_VM 0x100

static __always_inline void mt_clone_enter(u64 flags, u64 top) {
    u64 pt = bpf_get_current_pid_tgid();
    u32 pid = pt >> 32, tid = (u32)pt;
    if (!mt_is_tracked(pid))
        return;
    if (!(flags & MT_CLONE_VM)) {
        u64 *e = mt_stack_ends.lookup(&tid);
        top = e ? *e : 0;
    }
    if (top)
        mt_stack_clones.update(&tid, &top);
}

int mt_stack_clone3_enter(struct mt_sys_enter_tp *args) {
    u64 a[7] = {}; /* uapi struct clone_args: flags ... stack, stack_size */
    if (bpf_probe_read_user(a, sizeof(a), (void *)args->a[0]))
        return 0;
    mt_clone_enter(a[0], a[5] ? a[5] + a[6] : 0);
    return 0;
}

int mt_stack_clone_enter(struct mt_sys_enter_tp *args) {
    mt_clone_enter(args->a[0], args->a[1]);
    return 0;
}

int mt_stack_clone_exit(struct mt_sys_exit_tp *args) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u64 *top = mt_stack_clones.lookup(&tid);
    if (!top)
        return 0;
    if (args->ret > 0) {
        u32 child = (u32)args->ret;
        u64 end = *top;
        mt_stack_ends.update(&child, &end);
    }
    mt_stack_clones.delete(&tid);
    return 0;
}

int mt_stack_thread_exit(void *ctx) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    mt_stack_ends.delete(&tid);
    return 0;
}

/* Code that becomes executable without an attach stop (JIT code: anonymous PROT_EXEC
 * mappings, mprotect to PROT_EXEC) is kept from then on. */
#define MT_PROT_EXEC_ 4
#define MT_MAP_ANON_ 0x20

int mt_stack_mprotect_enter(struct mt_sys_enter_tp *args) {
    if (!(args->a[2] & MT_PROT_EXEC_) || !mt_is_tracked(bpf_get_current_pid_tgid() >> 32))
        return 0;
    struct mt_stack_regions *rg = mt_regions();
    if (rg && args->a[1])
        mt_mark(rg->kept, args->a[0], args->a[0] + args->a[1]);
    return 0;
}

int mt_stack_mmap_enter(struct mt_sys_enter_tp *args) {
    if (!(args->a[2] & MT_PROT_EXEC_) || !(args->a[3] & MT_MAP_ANON_))
        return 0;
    u64 pt = bpf_get_current_pid_tgid();
    u32 tid = (u32)pt;
    if (!mt_is_tracked(pt >> 32))
        return 0;
    u64 len = args->a[1];
    mt_stack_execmaps.update(&tid, &len);
    return 0;
}

int mt_stack_mmap_exit(struct mt_sys_exit_tp *args) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u64 *len = mt_stack_execmaps.lookup(&tid);
    if (!len)
        return 0;
    u64 l = *len;
    mt_stack_execmaps.delete(&tid);
    s64 ret = args->ret;
    struct mt_stack_regions *rg = mt_regions();
    if (rg && l && !(ret < 0 && ret > -4096))
        mt_mark(rg->kept, (u64)ret, (u64)ret + l);
    return 0;
}

#endif
