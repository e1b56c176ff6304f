/* Resident memory: kmem:rss_stat (always), madvise/mremap events (always), and with
 * MT_TRACK_FAULTS the user page faults that the anonymous-RSS reconstruction of
 * memtrack.process.anon_replay replays.
 *
 * No kernel struct is read. Tracepoint fields are read at the offsets of the running
 * kernel's format files, which memtrack.capture.rss passes in as MT_OFF_<EVENT>_<FIELD>
 * (the 6.1 headers bcc compiles against do not match newer kernels). The functions
 * are attached by name from userspace, so a missing tracepoint disables RSS with a
 * warning instead of failing the whole program's load.
 *
 * rss_stat fires in the context of whoever changed the counter: `curr` says whether
 * that task runs on the counted mm. Updates made by a tracked process on its own mm
 * teach the mm_id -> tgid ownership map; updates from elsewhere (reclaim, another
 * process's madvise, the exit/exec teardown of an mm) reach the owner only while that
 * mm_id is still the owner's current mm, and are flagged `external` so that processing
 * lets them only lower a counter. */

#define MT_TP(ctx, off, type) (*(type *)((char *)(ctx) + (off)))

/* Event kinds this part adds (memtrack.schema.EventKind). */
enum { MT_MADVISE = 12, MT_MREMAP = 13 };

/* rss ring record; memtrack.capture.rss.RSS_DTYPE matches it byte for byte. */
struct mt_rss_rec {
    u64 ts;
    u32 pid;
    u8 member;
    u8 external;
    u16 _pad;
    s64 bytes;
};

/* mt_rss_lost slots (memtrack.capture.rss.LOST_SLOTS). */
#define MT_LOST_RSS 0
#define MT_LOST_RSS_EVENTS 1
#define MT_LOST_FAULTS 2
#define MT_LOST_SYSCALL_STASH 3

BPF_RINGBUF_OUTPUT(mt_rss_ring, MT_RSS_RING_PAGES);
BPF_RINGBUF_OUTPUT(mt_rss_events, MT_RSS_EVENTS_RING_PAGES);
BPF_TABLE("lru_hash", u32, u32, mt_rss_owner, 65536); /* mm_id -> tgid */
BPF_TABLE("lru_hash", u32, u32, mt_rss_mm, 65536);    /* tgid -> its current mm_id */
BPF_ARRAY(mt_rss_lost, u64, 4);

static __always_inline void mt_rss_count_loss(int slot) {
    u64 *v = mt_rss_lost.lookup(&slot);
    if (v)
        __sync_fetch_and_add(v, 1);
}

int mt_rss_stat(void *ctx) {
    u32 mm_id = MT_TP(ctx, MT_OFF_RSS_MM_ID, u32);
    u32 curr = MT_TP(ctx, MT_OFF_RSS_CURR, u32);
    s32 member = MT_TP(ctx, MT_OFF_RSS_MEMBER, s32);
    s64 size = MT_TP(ctx, MT_OFF_RSS_SIZE, s64);
    u32 owner;
    u8 external;
    if (curr) {
        owner = bpf_get_current_pid_tgid() >> 32;
        if (!mt_is_tracked(owner))
            return 0;
        u32 *known = mt_rss_mm.lookup(&owner);
        if (!known || *known != mm_id) {
            if (known) {
                u32 stale = *known;
                mt_rss_owner.delete(&stale);
            }
            mt_rss_mm.update(&owner, &mm_id);
            mt_rss_owner.update(&mm_id, &owner);
        }
        external = 0;
    } else {
        u32 *o = mt_rss_owner.lookup(&mm_id);
        if (!o)
            return 0;
        owner = *o;
        u32 *cur = mt_rss_mm.lookup(&owner);
        if (!cur || *cur != mm_id)
            return 0;
        external = 1;
    }
    if (!mt_is_enabled())
        return 0;
    mt_backpressure(MT_RING_RSS);
    struct mt_rss_rec *r = mt_rss_ring.ringbuf_reserve(sizeof(struct mt_rss_rec));
    if (!r) {
        mt_rss_count_loss(MT_LOST_RSS);
        return 0;
    }
    r->ts = bpf_ktime_get_ns();
    r->pid = owner;
    r->member = member;
    r->external = external;
    r->_pad = 0;
    r->bytes = size;
    mt_rss_ring.ringbuf_submit(r, BPF_RB_NO_WAKEUP);
    return 0;
}

/* madvise and mremap: arguments stashed per thread at entry, the event emitted at a
 * successful return (an mremap's result is the new address). */
struct mt_rss_sysargs {
    u64 a[5];
};
BPF_HASH(mt_rss_sys, u32, struct mt_rss_sysargs, 16384);

static __always_inline int mt_rss_stash(u64 a0, u64 a1, u64 a2, u64 a3, u64 a4) {
    u64 id = bpf_get_current_pid_tgid();
    if (!mt_is_tracked(id >> 32))
        return 0;
    u32 tid = id;
    struct mt_rss_sysargs s = {{a0, a1, a2, a3, a4}};
    if (mt_rss_sys.update(&tid, &s))
        mt_rss_count_loss(MT_LOST_SYSCALL_STASH);
    return 0;
}

static __always_inline int mt_rss_emit(u8 kind, u64 addr, u64 old_addr, u64 size, u64 flags) {
    u64 id = bpf_get_current_pid_tgid();
    mt_backpressure(MT_RING_RSS_EVENTS);
    struct mt_event *e = mt_rss_events.ringbuf_reserve(sizeof(struct mt_event));
    if (!e) {
        mt_rss_count_loss(MT_LOST_RSS_EVENTS);
        return 0;
    }
    mt_fill_event(e, id >> 32, (u32)id, kind, MT_A_SYSCALL, flags, addr, old_addr, size, 0);
    mt_rss_events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
    return 0;
}

int mt_madvise_enter(void *ctx) {
    return mt_rss_stash(MT_TP(ctx, MT_OFF_MADVISE_START, u64),
                        MT_TP(ctx, MT_OFF_MADVISE_LEN_IN, u64),
                        MT_TP(ctx, MT_OFF_MADVISE_BEHAVIOR, s32), 0, 0);
}

int mt_madvise_exit(void *ctx) {
    u32 tid = bpf_get_current_pid_tgid();
    struct mt_rss_sysargs *s = mt_rss_sys.lookup(&tid);
    if (!s)
        return 0;
    struct mt_rss_sysargs a = *s;
    mt_rss_sys.delete(&tid);
    if (MT_TP(ctx, MT_OFF_SYSEXIT_RET, s64) != 0 || !mt_is_enabled())
        return 0;
    /* MADVISE: addr = start, size = length, flags = advice */
    return mt_rss_emit(MT_MADVISE, a.a[0], 0, a.a[1], a.a[2]);
}

int mt_mremap_enter(void *ctx) {
    return mt_rss_stash(MT_TP(ctx, MT_OFF_MREMAP_ADDR, u64),
                        MT_TP(ctx, MT_OFF_MREMAP_OLD_LEN, u64),
                        MT_TP(ctx, MT_OFF_MREMAP_NEW_LEN, u64),
                        MT_TP(ctx, MT_OFF_MREMAP_FLAGS, u64), 0);
}

int mt_mremap_exit(void *ctx) {
    u32 tid = bpf_get_current_pid_tgid();
    struct mt_rss_sysargs *s = mt_rss_sys.lookup(&tid);
    if (!s)
        return 0;
    struct mt_rss_sysargs a = *s;
    mt_rss_sys.delete(&tid);
    s64 ret = MT_TP(ctx, MT_OFF_SYSEXIT_RET, s64);
    if ((ret < 0 && ret > -4096) || !mt_is_enabled())
        return 0;
    /* MREMAP: addr = new address, old_addr = old address, size = new length,
     * flags = mremap flags (low 8 bits) | old length << 8 */
    return mt_rss_emit(MT_MREMAP, ret, a.a[0], a.a[2], (a.a[3] & 0xff) | (a.a[1] << 8));
}

#ifdef MT_TRACK_FAULTS
/* faults ring record; memtrack.capture.rss.FAULT_DTYPE matches it byte for byte. */
struct mt_fault_rec {
    u64 ts;
    u32 pid;
    u32 tid;
    u64 address;
    u32 error_code;
    u32 kernel; /* 1: a fault taken in kernel mode on a user address (copy_to_user ...) */
};
BPF_RINGBUF_OUTPUT(mt_faults_ring, MT_FAULTS_RING_PAGES);

static __always_inline int mt_fault(void *ctx, u32 kernel) {
    u64 id = bpf_get_current_pid_tgid();
    if (!mt_is_tracked(id >> 32) || !mt_is_enabled())
        return 0;
    u64 address = MT_TP(ctx, MT_OFF_FAULT_ADDRESS, u64);
    if (address >= 0x800000000000ULL)
        return 0;
    mt_backpressure(MT_RING_FAULTS);
    struct mt_fault_rec *f = mt_faults_ring.ringbuf_reserve(sizeof(struct mt_fault_rec));
    if (!f) {
        mt_rss_count_loss(MT_LOST_FAULTS);
        return 0;
    }
    f->ts = bpf_ktime_get_ns();
    f->pid = id >> 32;
    f->tid = id;
    f->address = address;
    f->error_code = MT_TP(ctx, MT_OFF_FAULT_ERROR_CODE, u64);
    f->kernel = kernel;
    mt_faults_ring.ringbuf_submit(f, BPF_RB_NO_WAKEUP);
    return 0;
}

int mt_fault_user(void *ctx) { return mt_fault(ctx, 0); }
int mt_fault_kernel(void *ctx) { return mt_fault(ctx, 1); }
#endif
