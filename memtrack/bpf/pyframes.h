/* Python frames: at an outer allocator entry, walk the calling thread's CPython
 * interpreter frames (bounded) and fold their (code object, instruction) chain into the
 * stack hash; emit one Python stack record per distinct chain (it names the native
 * stack's hash) and one code record per code object the first time it is seen.
 *
 * Nothing runs in the traced process: memtrack.capture.pyframes finds `_PyRuntime` in
 * the interpreter's dynamic symbols at each attach stop, reads its version from the
 * file, and puts the runtime's address and that version's offsets (derived from its
 * public headers, memtrack.capture.pyframes.OFFSETS) in mt_py_procs[pid]. A process
 * without an entry gets native frames only.
 *
 * The thread state: _PyRuntime.gilstate.tstate_current when it is the calling thread's
 * (it holds the GIL), else (and always on 3.12+, whose current thread state is a
 * thread-local) the interpreters' thread list is searched for it (a thread that
 * released the GIL still has its frames); a thread state is the caller's when its
 * native_thread_id is the caller's tid (3.10: when its thread_id, pthread_self(), is
 * the caller's FS base). Its frame is cframe->current_frame (3.11, 3.12) or its own
 * current_frame (3.13; 3.10: frame). A run of frames one evaluation call executed ends
 * at a frame with is_entry (3.11), just above a shim frame owned by the C stack (3.12,
 * 3.13; skipped) or at each frame (3.10: every frame is its own call). Each frame is one
 * read of its header (code, previous, the instruction, is_entry, owner; 3.10's
 * PyFrameObject: f_code, f_back, f_lasti: the walk is the same, at other offsets) and
 * one of the code object's MT_PY_SPAN bytes of immutable fields (from the first line to
 * the line table pointer), hashed into the code key: a code object freed and another
 * allocated at its address is a new key, so a code record is never reused for another
 * function.
 *
 * Code records carry what process needs to name frames (qualified name, file name,
 * first line, the line table and the version, which says its format), read here when
 * the key is new rather than later from /proc/PID/mem: the code object may be gone by
 * then (code compiled from a string, a module unloaded) and its address another's.
 *
 * Included after stacks.h (needs MT_NCPU, mt_fnv_step). memtrack.capture.pyframes
 * supplies MT_PY_RING_PAGES, MT_PY_SEEN, MT_PY_CODES and MT_PY_FORK_CHILD.
 *
 * Records (u64 words; memtrack.capture.pyframes parses them):
 *   stack: 1 | nframes << 8 | more << 24, hash, pid | tid << 32, native hash, then per
 *          frame (innermost first) code key, instruction index | is_entry << 32
 *   code:  2, code key, pid | tid << 32, code address,
 *          first line | line table bytes (whole) << 32,
 *          qualname len | kind << 16 | filename len << 32 | kind << 48, line table len,
 *          the version (major << 8 | minor), then the qualname (3.10: the name), the
 *          file name and the line table bytes, each padded to 8 bytes (lengths in bytes
 *          as read; kind: bytes per character). */
#ifndef MEMTRACK_PYFRAMES_H
#define MEMTRACK_PYFRAMES_H

#define MT_PY_DEPTH 128     /* frames walked at most (a power of two) */
#define MT_PY_THREADS 32    /* thread states searched at most */
#define MT_PY_NEW_CODES 8   /* code records emitted per allocation at most */
#define MT_PY_NAME 256      /* bytes of a qualified name kept */
#define MT_PY_FILE 512      /* bytes of a file name kept */
#define MT_PY_LINES 8192    /* bytes of a line table kept */
#define MT_PY_SPAN 88       /* bytes of a code object's immutable fields hashed */
#define MT_PY_FRAME 128     /* bytes of a frame header read at most (mt_py_proc.f_read) */
#define MT_PY_SHIMS 32      /* entry shim frames (3.12+) walked past at most */
#define MT_PY_CSTACK 3      /* _PyInterpreterFrame.owner of a 3.12+ shim: FRAME_OWNED_BY_CSTACK */
#define MT_PY_SHIM_MARK 0x5348494dULL

/* The offsets of one interpreter version (memtrack.capture.pyframes.OFFSETS). */
struct mt_py_proc {
    u64 runtime;            /* address of _PyRuntime in the process */
    u32 tstate_current;     /* in _PyRuntimeState (0: none, search the thread list) */
    u32 interp_head;        /* in _PyRuntimeState: interpreters.head */
    u32 threads_head;       /* in PyInterpreterState */
    u32 ts_next;            /* in PyThreadState */
    u32 ts_native_tid;      /* 3.10: thread_id (pthread_self()) */
    u32 ts_cframe;
    u32 cf_current;         /* in _PyCFrame: current_frame (3.10: PyThreadState.frame) */
    u32 f_code;             /* in _PyInterpreterFrame (3.13: f_executable) */
    u32 f_previous;         /* 3.10: PyFrameObject.f_back */
    u32 f_prev_instr;       /* the instruction executing (3.13: instr_ptr; 3.10: f_lasti) */
    u32 f_is_entry;         /* 3.11: the frame was entered from C */
    u32 co_span;            /* start of the MT_PY_SPAN bytes hashed */
    u32 co_firstlineno;     /* in PyCodeObject */
    u32 co_filename;
    u32 co_qualname;
    u32 co_linetable;
    u32 co_code;            /* co_code_adaptive: instruction 0 */
    u32 str_length;         /* in PyASCIIObject */
    u32 str_state;
    u32 str_ascii_data;     /* sizeof(PyASCIIObject) */
    u32 str_compact_data;   /* sizeof(PyCompactUnicodeObject) */
    u32 bytes_size;         /* ob_size */
    u32 bytes_data;         /* ob_sval */
    u32 f_owner;            /* _PyInterpreterFrame.owner */
    u32 shim;               /* 3.12+: a run ends at a shim frame (owner CSTACK), no is_entry */
    u32 cframe;             /* 1: the frame is tstate->cframe->current_frame (3.11, 3.12);
                             * 0: tstate->current_frame (3.13: cf_current in PyThreadState) */
    u32 f_read;             /* bytes of a frame read (its fields lie in them) */
    u32 instr_index;        /* 1: f_prev_instr is an int, the instruction's index (3.10) */
    u32 each_entry;         /* 1: every frame was entered from C (3.10) */
    u32 task_fsbase;        /* 3.10: offsetof(struct task_struct, thread.fsbase), the
                             * calling thread's pthread_self() on x86_64; 0: match by tid */
    u32 version;            /* major << 8 | minor, for the code records */
};

/* a record's header, then room for the strings (at masked offsets) and the line table */
#define MT_PY_OUT_WORDS (8 + (2 * (MT_PY_NAME + MT_PY_FILE) + MT_PY_LINES) / 8)

struct mt_py_scratch {
    u64 frames[2 * MT_PY_DEPTH];
    u64 code_addr[MT_PY_DEPTH];
    u64 out[MT_PY_OUT_WORDS];
    u64 fresh[MT_PY_NEW_CODES]; /* frames whose code key is new */
    u64 nframes;
    u64 more;
    u64 nnew;
    u64 missing;
    u64 frame; /* mt_py_frame's answer, for mt_py_capture */
};

enum mt_py_stat {
    MT_PY_CAPTURES = 0, MT_PY_WITH_FRAMES = 1, MT_PY_STACK_RECORDS = 2, MT_PY_CODE_RECORDS = 3,
    MT_PY_RING_FULL = 4, MT_PY_TRUNCATED = 5, MT_PY_NO_THREAD = 6, MT_PY_READ_FAILED = 7,
    MT_PY_NSTATS = 8,
};

BPF_HASH(mt_py_procs, u32, struct mt_py_proc, 4096);
BPF_ARRAY(mt_py_scratch, struct mt_py_scratch, MT_NCPU);
BPF_TABLE("lru_hash", u64, u8, mt_py_seen, MT_PY_SEEN);
BPF_TABLE("lru_hash", u64, u8, mt_py_codes, MT_PY_CODES);
BPF_PERCPU_ARRAY(mt_py_stats, u64, MT_PY_NSTATS);
BPF_RINGBUF_OUTPUT(mt_py_ring, MT_PY_RING_PAGES);

static __always_inline void mt_py_count(int idx) {
    u64 *v = mt_py_stats.lookup(&idx);
    if (v)
        *v += 1;
}

static __always_inline u64 mt_py_word(const void *base, u32 off) {
    u64 v = 0;
    bpf_probe_read_user(&v, sizeof(v), (const u8 *)base + off);
    return v;
}

/* The calling thread's PyThreadState, or 0. A thread state names its thread by
 * native_thread_id (its tid) or, on 3.10, by thread_id alone: pthread_self(), the FS
 * base the kernel keeps for the thread. */
static __always_inline u64 mt_py_tstate(const struct mt_py_proc *p, u32 tid) {
    u64 me = tid, mask = 0xffffffffULL;
    if (p->task_fsbase) {
        me = 0;
        bpf_probe_read_kernel(&me, sizeof(me), (u8 *)bpf_get_current_task() + p->task_fsbase);
        mask = ~0ULL;
        if (!me)
            return 0;
    }
    u64 ts = p->tstate_current ? mt_py_word((void *)p->runtime, p->tstate_current) : 0;
    if (ts && (mt_py_word((void *)ts, p->ts_native_tid) & mask) == me)
        return ts;
    u64 interp = mt_py_word((void *)p->runtime, p->interp_head);
    if (!interp)
        return 0;
    ts = mt_py_word((void *)interp, p->threads_head);
    u64 found = 0;
    MT_LOOP(i, MT_PY_THREADS)
        if (!ts)
            break;
        if ((mt_py_word((void *)ts, p->ts_native_tid) & mask) == me) {
            found = ts;
            break;
        }
        ts = mt_py_word((void *)ts, p->ts_next);
    MT_LOOP_END
    return found;
}

/* A Python string object's bytes into dst (at most cap, a power of two); returns its
 * length as read | bytes per character << 16. */
static __always_inline u64 mt_py_str(const struct mt_py_proc *p, u64 obj, u8 *dst, u32 cap) {
    u64 hdr[8] = {};
    if (!obj || bpf_probe_read_user(hdr, 48, (void *)obj))
        return 0;
    u64 length = hdr[(p->str_length / 8) & 7];
    u32 state = (u32)hdr[(p->str_state / 8) & 7];
    /* state: interned 2 bits, kind 3 bits, compact 1 bit, ascii 1 bit */
    u32 kind = (state >> 2) & 7;
    u32 compact = (state >> 5) & 1, ascii = (state >> 6) & 1;
    if (!compact || kind == 0)
        return 0;
    u64 n = length * kind;
    if (n > cap)
        n = cap;
    u64 data = obj + (ascii ? p->str_ascii_data : p->str_compact_data);
    if (n == 0 || n > cap)
        return kind << 16;
    if (bpf_probe_read_user(dst, n, (void *)data))
        return 0;
    return n | (u64)kind << 16;
}

/* Emit the code record of the code object at `code` (key `key`); 0 on success. */
static __always_inline int mt_py_code_record(struct mt_py_scratch *s, const struct mt_py_proc *p,
                                             u64 key, u64 code, u64 pidtid) {
    u64 *O = s->out;
    u64 span[16] = {};
    if (bpf_probe_read_user(span, MT_PY_SPAN, (void *)(code + p->co_span)))
        return -1;
#define MT_PY_FIELD(off) span[(((off) - p->co_span) / 8) & 15]
    u64 firstline = (u32)(MT_PY_FIELD(p->co_firstlineno) >>
                          (((p->co_firstlineno - p->co_span) & 7) * 8));
    u64 qualname = MT_PY_FIELD(p->co_qualname);
    u64 filename = MT_PY_FIELD(p->co_filename);
    u64 linetable = MT_PY_FIELD(p->co_linetable);
#undef MT_PY_FIELD
    u8 *data = (u8 *)&O[8];
    u64 q = mt_py_str(p, qualname, data, MT_PY_NAME);
    u64 qlen = (q & 0xffff) > MT_PY_NAME ? MT_PY_NAME : q & 0xffff;
    u64 qpad = (qlen + 7) & ~7ULL;
    u64 f = mt_py_str(p, filename, data + (qpad & (MT_PY_NAME * 2 - 1)), MT_PY_FILE);
    u64 flen = (f & 0xffff) > MT_PY_FILE ? MT_PY_FILE : f & 0xffff;
    u64 fpad = (flen + 7) & ~7ULL;
    u64 ltsize = linetable ? mt_py_word((void *)linetable, p->bytes_size) : 0;
    u64 lt = ltsize > MT_PY_LINES ? MT_PY_LINES : ltsize;
    u64 at = (qpad + fpad) & (2 * (MT_PY_NAME + MT_PY_FILE) - 1);
    if (lt > 0 && lt <= MT_PY_LINES &&
        bpf_probe_read_user(data + at, lt, (void *)(linetable + p->bytes_data)))
        lt = 0;
    O[0] = 2;
    O[1] = key;
    O[2] = pidtid;
    O[3] = code;
    O[4] = firstline | (ltsize & 0xffffffff) << 32;
    O[5] = qlen | (q >> 16 & 7) << 16 | flen << 32 | (f >> 16 & 7) << 48;
    O[6] = lt;
    O[7] = p->version;
    u64 len = 64 + at + ((lt + 7) & ~7ULL);
    if (len > MT_PY_OUT_WORDS * 8)
        len = MT_PY_OUT_WORDS * 8;
    mt_backpressure(MT_RING_PYFRAMES);
    if (mt_py_ring.ringbuf_output(O, len, BPF_RB_NO_WAKEUP)) {
        mt_py_count(MT_PY_RING_FULL);
        return -1;
    }
    mt_py_count(MT_PY_CODE_RECORDS);
    return 0;
}

/* The calling thread's innermost Python frame (a _PyInterpreterFrame), or 0 when its
 * process has no known interpreter, the thread no thread state, or no Python code runs
 * on it; also left in scratch for mt_py_capture (the stack capture in between then
 * carries no register of it: one verifier state, whatever it was). */
static __always_inline u64 mt_py_frame(u32 pid, u32 tid) {
    int cpu = bpf_get_smp_processor_id();
    struct mt_py_scratch *s = mt_py_scratch.lookup(&cpu);
    if (!s)
        return 0;
    volatile struct mt_py_scratch *vs = s;
    vs->frame = 0;
    struct mt_py_proc *p = mt_py_procs.lookup(&pid);
    if (!p)
        return 0;
    mt_py_count(MT_PY_CAPTURES);
    u64 ts = mt_py_tstate(p, tid);
    if (!ts) {
        mt_py_count(MT_PY_NO_THREAD);
        return 0;
    }
    /* 3.11, 3.12: the thread state's _PyCFrame holds the current frame; 3.13, 3.10: itself */
    u64 cframe = p->cframe ? mt_py_word((void *)ts, p->ts_cframe) : ts;
    vs->frame = cframe ? mt_py_word((void *)cframe, p->cf_current) : 0;
    return vs->frame;
}

/* The stack hash of an allocation: `native` folded with the thread's Python frames from
 * the frame mt_py_frame found outward, or `native` itself when there are none. */
static __always_inline u64 mt_py_capture(u32 pid, u32 tid, u64 native) {
    int cpu = bpf_get_smp_processor_id();
    struct mt_py_scratch *s = mt_py_scratch.lookup(&cpu);
    if (!s)
        return native;
    volatile struct mt_py_scratch *vs = s;
    u64 frame = vs->frame;
    if (!frame)
        return native;
    struct mt_py_proc *p = mt_py_procs.lookup(&pid);
    if (!p)
        return native;
    u64 h = mt_fnv_step(MT_FNV_OFFSET, native);
    /* the frame count lives in scratch (read back through a volatile pointer): the
     * verifier carries one state per iteration, whatever the shims skipped */
    vs->nframes = 0;
    vs->more = 0;
    MT_LOOP(i, MT_PY_DEPTH + MT_PY_SHIMS)
        if (!frame)
            break;
        u64 n = vs->nframes;
        if (n >= MT_PY_DEPTH)
            break;
        u64 fr[16] = {};
        u64 span[16] = {};
        if (bpf_probe_read_user(fr, p->f_read & (MT_PY_FRAME - 1), (void *)frame)) {
            mt_py_count(MT_PY_READ_FAILED);
            break;
        }
        u64 code = fr[(p->f_code / 8) & 15];
        u64 prev = fr[(p->f_previous / 8) & 15];
        u64 instr = fr[(p->f_prev_instr / 8) & 15];
        u64 entry = (fr[(p->f_is_entry / 8) & 15] >> ((p->f_is_entry & 7) * 8)) & 1;
        u64 owner = (fr[(p->f_owner / 8) & 15] >> ((p->f_owner & 7) * 8)) & 0xff;
        if (p->each_entry)
            entry = 1;
        if (p->shim) {
            if (owner == MT_PY_CSTACK) {
                /* a shim: the frame before it began a run (entered from C) */
                if (n > 0)
                    s->frames[(2 * n - 1) & (2 * MT_PY_DEPTH - 1)] |= 1ULL << 32;
                h = mt_fnv_step(h, MT_PY_SHIM_MARK);
                frame = prev;
                continue;
            }
            entry = 0;
        }
        if (!code || bpf_probe_read_user(span, MT_PY_SPAN, (void *)(code + p->co_span))) {
            mt_py_count(MT_PY_READ_FAILED);
            break;
        }
        u64 key = mt_fnv_step(MT_FNV_OFFSET ^ pid, code);
#pragma unroll
        for (int j = 0; j < MT_PY_SPAN / 8; j++)
            key = mt_fnv_step(key, span[j]);
        key = key ? key : 1;
        /* the instruction's index: 3.10 keeps it (f_lasti, an int; -1 before the first),
         * later versions a pointer into the code's instructions */
        u64 index = p->instr_index ? (u32)(instr >> ((p->f_prev_instr & 7) * 8))
                                   : (instr - code - p->co_code) / 2;
        u64 w = (index & 0xffffffff) | entry << 32;
        s->frames[(2 * n) & (2 * MT_PY_DEPTH - 1)] = key;
        s->frames[(2 * n + 1) & (2 * MT_PY_DEPTH - 1)] = w;
        s->code_addr[n & (MT_PY_DEPTH - 1)] = code;
        h = mt_fnv_step(mt_fnv_step(h, key), w);
        vs->nframes = n + 1;
        frame = prev;
    MT_LOOP_END
    u64 n = vs->nframes;
    if (frame && n > 0) {
        vs->more = 1;
        mt_py_count(MT_PY_TRUNCATED);
    }
    if (n == 0)
        return native;
    mt_py_count(MT_PY_WITH_FRAMES);
    h = mt_fnv_step(h, n);
    h = h ? h : 1;
    if (mt_py_seen.lookup(&h))
        return h;

    /* a new chain: its new code objects' records first (the first MT_PY_NEW_CODES of
     * them; the others at a later allocation), then the stack record. The loops leave
     * their counts in scratch (read back through a volatile pointer), so the verifier
     * carries one state on instead of one per count. */
    u64 pidtid = pid | (u64)tid << 32;
    vs->nnew = 0;
    vs->missing = 0;
    MT_LOOP(i, MT_PY_DEPTH)
        if (i >= vs->nframes)
            break;
        u64 key = s->frames[(2 * i) & (2 * MT_PY_DEPTH - 1)];
        if (mt_py_codes.lookup(&key))
            continue;
        u64 k = vs->nnew;
        if (k >= MT_PY_NEW_CODES) {
            vs->missing = 1;
            break;
        }
        s->fresh[k & (MT_PY_NEW_CODES - 1)] = i;
        vs->nnew = k + 1;
    MT_LOOP_END
#pragma clang loop unroll(disable)
    for (int k = 0; k < MT_PY_NEW_CODES; k++) {
        if (k >= vs->nnew)
            break;
        u64 i = s->fresh[k] & (MT_PY_DEPTH - 1);
        if (i >= MT_PY_DEPTH)
            break;
        u64 key = s->frames[(2 * i) & (2 * MT_PY_DEPTH - 1)];
        if (mt_py_code_record(s, p, key, s->code_addr[i], pidtid)) {
            vs->missing = 1;
            continue;
        }
        u8 one = 1;
        mt_py_codes.update(&key, &one);
    }
    n = vs->nframes;
    u64 flen = n * 16;
    if (flen == 0 || flen > MT_PY_DEPTH * 16)
        return h;
    u64 *O = s->out;
    O[0] = 1 | n << 8 | vs->more << 24;
    O[1] = h;
    O[2] = pidtid;
    O[3] = native;
    bpf_probe_read_kernel(&O[4], flen, s->frames);
    mt_backpressure(MT_RING_PYFRAMES);
    if (mt_py_ring.ringbuf_output(O, 32 + flen, BPF_RB_NO_WAKEUP)) {
        mt_py_count(MT_PY_RING_FULL);
        return h;
    }
    mt_py_count(MT_PY_STACK_RECORDS);
    if (!vs->missing) {
        u8 one = 1;
        mt_py_seen.update(&h, &one);
    }
    return h;
}

/* sched:sched_process_fork (named: lifecycle.c owns the TRACEPOINT_PROBE names): a fork
 * child runs its parent's interpreter at the same addresses until it execs (the exec's
 * attach stop sets or removes its entry). MT_PY_FORK_CHILD: child_pid's offset in the
 * tracepoint's record, from its tracefs format. */
int mt_py_fork(void *args) {
    u32 parent = bpf_get_current_pid_tgid() >> 32;
    struct mt_py_proc *p = mt_py_procs.lookup(&parent);
    if (!p)
        return 0;
    u32 child = *(s32 *)((u8 *)args + MT_PY_FORK_CHILD);
    if (child == parent)
        return 0;
    struct mt_py_proc copy = *p;
    mt_py_procs.update(&child, &copy);
    return 0;
}

#endif
