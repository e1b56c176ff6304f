/* Allocation stacks: copy the user stack at allocator entry, hash it, dedupe it and
 * emit one stack record per distinct hash on the mt_stack_ring ring buffer.
 *
 * Included after common.h. memtrack.capture.stacks.StacksPart supplies the sizes:
 *   MT_STACK_BUDGET      bytes copied from sp upward (multiple of 512, at most 32768)
 *   MT_STACK_WORDS       a power of two >= MT_STACK_BUDGET / 8
 *   MT_STACK_OUT_WORDS   a power of two >= MT_STACK_WORDS and >= the largest header
 *                        (record positions are masked with it; s->out holds twice it)
 *   MT_STACK_RING_PAGES  pages of the record ring
 *   MT_STACK_SEEN        entries of the dedupe LRU set
 *   MT_STACK_REFS        per-thread references kept (MT_STACK_DELTA only)
 *   MT_NCPU              possible CPUs (scratch slots)
 *   MT_STACK_DELTA       defined: XOR-delta-encode records against the thread's last one
 *
 * Record layout (little-endian u64 words; memtrack.schema.stackrecord describes it):
 *   0 hash   1 ref_hash (0: keyframe or raw)   2 ts   3 pid | tid << 32   4 sp
 *   5 copy_len | fp_count << 32 | nfix << 48 | flags << 56 (1 truncated, 2 delta)
 *   6 body_len (bytes)
 *   fp_count return addresses (bpf_get_stack, user frame pointers; entry 0 is rip)
 *   nfix (slot, original value) pairs: uretprobe trampolines replaced in the copy
 *   body: raw   regs[17] then copy_len bytes of stack
 *         delta reg_mask, the nonzero regs ^ ref regs, group_mask, one word bitmap per
 *               present 512 B group, then the nonzero words of copy ^ reference
 *               (aligned by address, the reference zero outside its range)
 *
 * The verifier walks every loop (bcc 0.26 cannot use bpf_loop), so the program is
 * written for it to walk each loop once:
 * - the copy and hash loops leave through data-dependent breaks; their results are
 *   stored to scratch and read back through a volatile pointer, and so are the header
 *   positions before the encoder, which leaves one verifier state to carry on with
 *   instead of one per exit;
 * - per word everything is branch-free (mt_nz/mt_lt hide `x | -x` and `a - b` from
 *   clang, which would turn them back into branches: 2^n paths);
 * - `[-1, 0] & constant` makes the verifier fork, so the FNV seeds come from map memory;
 * - a new thread gets an empty reference in the map first, so the encoder only ever
 *   reads a reference through one kind of pointer;
 * - the per-word loops stay rolled: every allocator program inlines this capture, and
 *   unrolled copies multiplied the compile time of the capture program.
 * Verified instructions of a probe that only captures (kernel 6.18): about 67 k at 8 KiB
 * and 260 k at 32 KiB with delta encoding, 9 k and 28 k raw (bench/bench_stacks.py
 * prints those of the capture core's malloc probe). */
#ifndef MEMTRACK_STACKS_H
#define MEMTRACK_STACKS_H

#include <uapi/linux/ptrace.h>

#define MT_FNV_OFFSET 0xcbf29ce484222325ULL
#define MT_FNV_PRIME 0x100000001b3ULL
#define MT_CHUNK 512
#define MT_GROUP_WORDS 64
#define MT_NCHUNK (MT_STACK_BUDGET / MT_CHUNK)
#define MT_NREGS 17
#define MT_FP_DEPTH 64
#define MT_HDR_WORDS 7
#define MT_SW_MASK (MT_STACK_WORDS - 1)
#define MT_OW_MASK (MT_STACK_OUT_WORDS - 1)

#define MT_SF_TRUNCATED 1
#define MT_SF_DELTA 2

/* mt_stack_stats indexes (per CPU; StacksPart sums them). */
enum mt_stack_stat {
    MT_SS_COPY_FAILED = 0, MT_SS_TRUNCATED = 1, MT_SS_DEDUPE_FULL = 2, MT_SS_RING_FULL = 3,
    MT_SS_DELTA_FALLBACK = 4, MT_SS_RECORDS = 5, MT_SS_DEDUPED = 6, MT_SS_CAPTURES = 7,
    MT_SS_NSTATS = 8,
};

/* A thread's last emitted copy (the delta reference), also the scratch copy. */
struct mt_stack_ref {
    u64 hash;
    u64 sp;
    u64 nwords;
    u64 regs[MT_NREGS];
    u64 words[MT_STACK_WORDS];
};

struct mt_stack_scratch {
    struct mt_stack_ref cur;
    u64 fix[2 * MT_MAX_NEST];
    u64 tmp[MT_STACK_WORDS];
    u64 out[2 * MT_STACK_OUT_WORDS];
    u64 nwords;
    u64 truncated;
    u64 hash;
    u64 nfix;
    u64 nfp;
    u64 pos;
    u64 rn;
    u64 ref_sp;
    u64 ref_hash;
    u64 seed[4];
    u64 tail;
};

BPF_ARRAY(mt_stack_scratch, struct mt_stack_scratch, MT_NCPU);
BPF_TABLE("lru_hash", u64, u8, mt_stack_seen, MT_STACK_SEEN);
BPF_PERCPU_ARRAY(mt_stack_stats, u64, MT_SS_NSTATS);
BPF_RINGBUF_OUTPUT(mt_stack_ring, MT_STACK_RING_PAGES);
#ifdef MT_STACK_DELTA
BPF_TABLE("lru_hash", u32, struct mt_stack_ref, mt_stack_refs, MT_STACK_REFS);
#endif

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

/* 1 when k, read as signed, is >= 0. */
static __always_inline u64 mt_ge0(u64 k) {
    u64 t = ~k;
    asm volatile("" : "+r"(t));
    return t >> 63;
}

static __always_inline u64 mt_fnv_step(u64 h, u64 w) {
    return (h ^ w) * MT_FNV_PRIME;
}

/* Copy [sp, sp + budget) in 512 B chunks; the first chunk that faults ends the copy
 * after its readable part (the end of the stack is page-aligned). Leaves the word count
 * and the truncation flag in s. */
static __always_inline void mt_stack_copy(struct mt_stack_scratch *s, u64 sp) {
    int k;
#pragma clang loop unroll(disable)
    for (k = 0; k < MT_NCHUNK; k++) {
        if (bpf_probe_read_user(&s->cur.words[k * MT_GROUP_WORDS], MT_CHUNK,
                                (void *)(sp + (u64)k * MT_CHUNK)))
            break;
    }
    u64 n = (u64)k * MT_GROUP_WORDS;
    u64 trunc = 0;
    if (k < MT_NCHUNK) {
        u64 addr = sp + (u64)k * MT_CHUNK;
        u64 part = (0 - addr) & 4095;
        if (part > 0 && part < MT_CHUNK &&
            bpf_probe_read_user(&s->cur.words[(k * MT_GROUP_WORDS) & MT_SW_MASK], part,
                                (void *)addr) == 0)
            n += part / 8;
    } else {
        u64 probe = 0;
        trunc = bpf_probe_read_user(&probe, sizeof(probe), (void *)(sp + MT_STACK_BUDGET)) == 0;
    }
    s->nwords = n;
    s->truncated = trunc;
}

/* Put back the return addresses that live uretprobes replaced with their trampoline
 * (common.h mt_retslots) and list the restored slots in s->fix; branch-free per slot.
 * Leaves the count in s->nfix. */
static __always_inline void mt_stack_fixups(struct mt_stack_scratch *s, u32 tid, u64 sp, u64 n) {
    struct mt_retslots *rs = mt_retslots.lookup(&tid);
    u64 nfix = 0;
    if (rs) {
        u64 depth = rs->depth;
#pragma unroll
        for (int i = 0; i < MT_MAX_NEST; i++) {
            u64 off = rs->slot[i] - sp;
            u64 idx = (off / 8) & MT_SW_MASK;
            u64 ok = mt_lt(i, depth) & (1 - mt_nz(off & 7)) & mt_lt(off / 8, n) &
                     mt_lt(off, 1ULL << 32);
            u64 m = 0 - ok;
            u64 old = s->cur.words[idx];
            s->cur.words[idx] = (rs->value[i] & m) | (old & ~m);
            s->fix[(2 * nfix) & (2 * MT_MAX_NEST - 1)] = rs->slot[i];
            s->fix[(2 * nfix + 1) & (2 * MT_MAX_NEST - 1)] = rs->value[i];
            nfix += ok;
        }
    }
    s->nfix = nfix;
}

/* FNV-1a over the copy: word i into lane i % 4 (lanes seeded offset ^ lane), the lanes
 * folded in order, then the length in bytes. 0 means "no stack" and is never returned. */
static __always_inline u64 mt_stack_hash(struct mt_stack_scratch *s, u64 n) {
    /* The seeds go through map memory so that the verifier does not know them: it
     * forks its state on `[-1, 0] & constant`. */
    volatile u64 *seed = s->seed;
    seed[0] = MT_FNV_OFFSET;
    seed[1] = MT_FNV_OFFSET ^ 1;
    seed[2] = MT_FNV_OFFSET ^ 2;
    seed[3] = MT_FNV_OFFSET ^ 3;
    u64 h0 = seed[0], h1 = seed[1], h2 = seed[2], h3 = seed[3];
    int g;
#pragma clang loop unroll(disable)
    for (g = 0; g < MT_NCHUNK; g++) {
        if ((u64)(g + 1) * MT_GROUP_WORDS > n)
            break;
#pragma clang loop unroll(disable)
        for (int j = 0; j < MT_GROUP_WORDS; j += 4) {
            u64 *w = &s->cur.words[(g * MT_GROUP_WORDS + j) & MT_SW_MASK];
            h0 = mt_fnv_step(h0, w[0]);
            h1 = mt_fnv_step(h1, w[1]);
            h2 = mt_fnv_step(h2, w[2]);
            h3 = mt_fnv_step(h3, w[3]);
        }
    }
    /* The group the copy ends in (past the copy when it is whole groups): words beyond
     * n leave their lane alone. Lanes and position go through scratch: one state. */
    seed[0] = h0;
    seed[1] = h1;
    seed[2] = h2;
    seed[3] = h3;
    s->tail = (u64)g * MT_GROUP_WORDS;
    h0 = seed[0];
    h1 = seed[1];
    h2 = seed[2];
    h3 = seed[3];
    u64 base = ((volatile struct mt_stack_scratch *)s)->tail;
#pragma clang loop unroll(disable)
    for (int j = 0; j < MT_GROUP_WORDS; j += 4) {
        u64 i = base + j;
        u64 *w = &s->cur.words[i & (MT_SW_MASK & ~3ULL)];
        u64 m0 = 0 - mt_lt(i, n), m1 = 0 - mt_lt(i + 1, n), m2 = 0 - mt_lt(i + 2, n),
            m3 = 0 - mt_lt(i + 3, n);
        h0 = (mt_fnv_step(h0, w[0]) & m0) | (h0 & ~m0);
        h1 = (mt_fnv_step(h1, w[1]) & m1) | (h1 & ~m1);
        h2 = (mt_fnv_step(h2, w[2]) & m2) | (h2 & ~m2);
        h3 = (mt_fnv_step(h3, w[3]) & m3) | (h3 & ~m3);
    }
    u64 h = MT_FNV_OFFSET;
    h = mt_fnv_step(h, h0);
    h = mt_fnv_step(h, h1);
    h = mt_fnv_step(h, h2);
    h = mt_fnv_step(h, h3);
    h = mt_fnv_step(h, n * 8);
    if (h == 0)
        h = 1;
    s->hash = h;
    return h;
}

static __always_inline void mt_stack_regs(struct mt_stack_scratch *s, struct pt_regs *ctx) {
    u64 *r = s->cur.regs;
    r[0] = ctx->ax; r[1] = ctx->dx; r[2] = ctx->cx; r[3] = ctx->bx;
    r[4] = ctx->si; r[5] = ctx->di; r[6] = ctx->bp; r[7] = ctx->sp;
    r[8] = ctx->r8; r[9] = ctx->r9; r[10] = ctx->r10; r[11] = ctx->r11;
    r[12] = ctx->r12; r[13] = ctx->r13; r[14] = ctx->r14; r[15] = ctx->r15;
    r[16] = ctx->ip;
}

#ifdef MT_STACK_DELTA
/* XOR-encode the copy against ref (rn words at ref_sp; rn = 0: keyframe) into
 * s->out from word `pos`. Returns the position after the body. */
static __always_inline u64 mt_stack_encode(struct mt_stack_scratch *s, struct mt_stack_ref *ref,
                                           u64 rn, u64 ref_sp, u64 sp, u64 n, u64 pos) {
    u64 has_ref = 0 - mt_nz(rn);
    u64 regmask = 0;
    u64 rpos = pos + 1;
#pragma unroll
    for (int r = 0; r < MT_NREGS; r++) {
        u64 x = s->cur.regs[r] ^ (ref->regs[r] & has_ref);
        u64 nz = mt_nz(x);
        s->out[rpos & MT_OW_MASK] = x;
        rpos += nz;
        regmask |= nz << r;
    }
    s->out[pos & MT_OW_MASK] = regmask;
    u64 gpos = rpos;       /* group mask */
    u64 bpos = gpos + 1;   /* next bitmap */
    u64 wn = 0;            /* nonzero words so far, in s->tmp */
    u64 gmask = 0;
    u64 shift = (u64)((s64)(sp - ref_sp) >> 3); /* reference word = i + shift */
#pragma clang loop unroll(disable)
    for (int g = 0; g < MT_NCHUNK; g++) {
        if ((u64)g * MT_GROUP_WORDS >= n)
            break;
        u64 bitmap = 0;
#pragma clang loop unroll(disable)
        for (int j = 0; j < MT_GROUP_WORDS; j++) {
            u64 i = (u64)g * MT_GROUP_WORDS + j;
            u64 k = i + shift;
            u64 kin = (0 - mt_lt(k, rn)) & (0 - mt_ge0(k));
            u64 x = s->cur.words[i & MT_SW_MASK] ^ (ref->words[k & MT_SW_MASK] & kin);
            x &= 0 - mt_lt(i, n);
            u64 nz = mt_nz(x);
            s->tmp[wn & MT_SW_MASK] = x;
            wn += nz;
            bitmap |= nz << j;
        }
        u64 present = mt_nz(bitmap);
        s->out[bpos & MT_OW_MASK] = bitmap;
        bpos += present;
        gmask |= present << g;
    }
    s->out[gpos & MT_OW_MASK] = gmask;
    u64 bytes = wn * 8;
    if (bytes > MT_STACK_WORDS * 8)
        bytes = MT_STACK_WORDS * 8;
    if (bytes)
        bpf_probe_read_kernel(&s->out[bpos & MT_OW_MASK], bytes, s->tmp);
    return bpos + wn;
}
#endif

/* A raw body at s->out[pos]: the registers, then the copy. Returns the position after. */
static __always_inline u64 mt_stack_raw_body(struct mt_stack_scratch *s, u64 pos, u64 n) {
#pragma unroll
    for (int r = 0; r < MT_NREGS; r++)
        s->out[(pos + r) & MT_OW_MASK] = s->cur.regs[r];
    pos += MT_NREGS;
    if (n > MT_STACK_WORDS)
        n = MT_STACK_WORDS;
    bpf_probe_read_kernel(&s->out[pos & MT_OW_MASK], n * 8, s->cur.words);
    return pos + n;
}

/* Capture the calling thread's stack; returns its hash (0: no stack). Emits a stack
 * record when the hash was not seen before. */
static __always_inline u64 mt_stack_capture(struct pt_regs *ctx, u32 pid, u32 tid) {
    int cpu = bpf_get_smp_processor_id();
    struct mt_stack_scratch *s = mt_stack_scratch.lookup(&cpu);
    if (!s)
        return 0;
    volatile struct mt_stack_scratch *vs = s;
    mt_stack_count(MT_SS_CAPTURES);
    u64 sp = ctx->sp;
    mt_stack_copy(s, sp);
    u64 n = vs->nwords;
    if (n == 0 || n > MT_STACK_WORDS) {
        mt_stack_count(MT_SS_COPY_FAILED);
        return 0;
    }
    mt_stack_fixups(s, tid, sp, n);
    n = vs->nwords;
    mt_stack_hash(s, n);
    u64 h = vs->hash;
    n = vs->nwords;
    u64 nfix = vs->nfix;
    if (n > MT_STACK_WORDS)
        return 0;
    if (mt_stack_seen.lookup(&h)) {
        mt_stack_count(MT_SS_DEDUPED);
        return h;
    }
    u64 trunc = vs->truncated;
    if (trunc)
        mt_stack_count(MT_SS_TRUNCATED);
    mt_stack_regs(s, ctx);

    long got = bpf_get_stack(ctx, &s->out[MT_HDR_WORDS], MT_FP_DEPTH * 8, BPF_F_USER_STACK);
    u64 nfp = got > 0 ? (u64)got / 8 : 0;
    if (nfp > MT_FP_DEPTH)
        nfp = MT_FP_DEPTH;
    if (nfix > MT_MAX_NEST)
        nfix = MT_MAX_NEST;
    u64 pos = MT_HDR_WORDS + nfp;
#pragma unroll
    for (int i = 0; i < 2 * MT_MAX_NEST; i++)
        s->out[(pos + i) & MT_OW_MASK] = s->fix[i];
    pos += 2 * nfix;
    u64 ref_hash = 0;
    u64 flags = trunc ? MT_SF_TRUNCATED : 0;
    u64 body = pos;

#ifdef MT_STACK_DELTA
    struct mt_stack_ref *ref = mt_stack_refs.lookup(&tid);
    if (!ref) {
        /* A new thread: an empty reference, so that a keyframe is the delta against
         * nothing and the encoder has one kind of reference pointer to verify. */
        s->cur.hash = 0;
        s->cur.nwords = 0;
        mt_stack_refs.update(&tid, &s->cur);
        ref = mt_stack_refs.lookup(&tid);
    }
    if (ref) {
        u64 rn = ref->nwords;
        u64 ref_sp = ref->sp;
        ref_hash = ref->hash;
        if (rn > MT_STACK_WORDS || sp - ref_sp + (1ULL << 40) > (2ULL << 40)) {
            /* unusable reference (sp moved by more than 1 TiB): a keyframe */
            rn = 0;
            ref_hash = 0;
        }
        /* One verifier state from here on, whatever the path. */
        vs->pos = pos;
        vs->nfp = nfp;
        vs->nfix = nfix;
        vs->rn = rn;
        vs->ref_sp = ref_sp;
        vs->ref_hash = ref_hash;
        pos = vs->pos;
        n = vs->nwords;
        if (n > MT_STACK_WORDS)
            return 0;
        pos = mt_stack_encode(s, ref, vs->rn, vs->ref_sp, sp, n, pos);
        flags |= MT_SF_DELTA;
        nfp = vs->nfp;
        nfix = vs->nfix;
        ref_hash = vs->ref_hash;
        body = vs->pos;
    } else {
        /* No reference could be stored for this thread: a raw record instead. */
        mt_stack_count(MT_SS_DELTA_FALLBACK);
        pos = mt_stack_raw_body(s, pos, n);
    }
#else
    pos = mt_stack_raw_body(s, pos, n);
#endif

    s->out[0] = h;
    s->out[1] = ref_hash;
    s->out[2] = bpf_ktime_get_ns();
    s->out[3] = pid | ((u64)tid << 32);
    s->out[4] = sp;
    s->out[5] = (n * 8) | (nfp << 32) | (nfix << 48) | (flags << 56);
    s->out[6] = (pos - body) * 8;
    u64 len = pos * 8;
    if (len > 2 * MT_STACK_OUT_WORDS * 8)
        len = 2 * MT_STACK_OUT_WORDS * 8;
    mt_backpressure(MT_RING_STACKS);
    if (mt_stack_ring.ringbuf_output((void *)&s->out[0], len, 0)) {
        mt_stack_count(MT_SS_RING_FULL);
        return h;
    }
    mt_stack_count(MT_SS_RECORDS);
    u8 one = 1;
    if (mt_stack_seen.update(&h, &one))
        mt_stack_count(MT_SS_DEDUPE_FULL);
#ifdef MT_STACK_DELTA
    if (ref) {
        /* The record is out: it becomes the thread's reference. */
        bpf_probe_read_kernel(ref->words, n * 8, s->cur.words);
#pragma unroll
        for (int r = 0; r < MT_NREGS; r++)
            ref->regs[r] = s->cur.regs[r];
        ref->sp = sp;
        ref->nwords = n;
        ref->hash = h;
    }
#endif
    return h;
}

#endif
