/* Process tree, address-space syscalls and on-demand attach requests.
 *
 * Follows the tracked tree with task_newtask (fork/clone: clone flags tell threads
 * from processes) and sched_process_exec/exit, emits FORK/EXEC/EXIT events, mmap /
 * munmap / brk events for successful calls, and asks userspace to classify and probe
 * every file a tracked process maps executable (and every exec'd image, and every new
 * process when probes are scoped): it submits an attach request, then stops the whole
 * process with SIGSTOP; userspace attaches the probes and sends SIGCONT. Also writes the REGION events of the control FIFO's
 * begin/end (mt_region_mark). Uses mt_events, mt_emit and mt_loss of alloc.c. */

#ifndef MT_ATTACH_PAGES
#define MT_ATTACH_PAGES 64
#endif

#define MT_PROT_EXEC 0x4
#define MT_MAP_ANONYMOUS 0x20
#define MT_CLONE_THREAD 0x10000

#define MT_REQ_MMAP 1
#define MT_REQ_EXEC 2 /* off = the exec'ing thread's tid before the exec */
#define MT_REQ_FORK 3
#define MT_CONFIG_SCOPED 1

/* memtrack.capture.core.ATTACH_DTYPE */
struct mt_attach_req {
    u64 ts;
    u32 pid;
    u32 tid;
    u32 reason;
    s32 fd;
    u64 len;
    u64 off;
};
BPF_RINGBUF_OUTPUT(mt_attach, MT_ATTACH_PAGES);

/* Spawned roots waiting for their exec: tracked from the exec on, so nothing the
 * spawning stub does between fork and exec is recorded. */
BPF_HASH(mt_pending, u32, u8, 1024);
/* Exit status of each tracked process as the kernel reports it (code << 8 | signal). */
BPF_HASH(mt_exitcode, u32, u64, 65536);

struct mt_sys_args {
    u64 a0, a1, a2, a3, a4;
};
BPF_HASH(mt_sys, u32, struct mt_sys_args, 65536);
BPF_HASH(mt_brk, u32, u64, 65536);

static __always_inline void mt_request_attach(u32 pid, u32 tid, u32 reason, s32 fd, u64 len,
                                              u64 off) {
    struct mt_attach_req *r = mt_attach.ringbuf_reserve(sizeof(struct mt_attach_req));
    if (!r) {
        mt_loss(MT_L_ATTACH_DROPPED);
        return;
    }
    r->ts = bpf_ktime_get_ns();
    r->pid = pid;
    r->tid = tid;
    r->reason = reason;
    r->fd = fd;
    r->len = len;
    r->off = off;
    mt_attach.ringbuf_submit(r, 0);
    bpf_send_signal(MT_SIGSTOP);
}

TRACEPOINT_PROBE(task, task_newtask) {
    u64 pt = bpf_get_current_pid_tgid();
    u32 pid = pt >> 32, tid = (u32)pt;
    if (!mt_is_tracked(pid))
        return 0;
    u32 child = args->pid;
    u64 flags = args->clone_flags;
    if (!(flags & MT_CLONE_THREAD)) {
        u8 one = 1;
        mt_tracked.update(&child, &one);
    }
    mt_emit(pid, tid, MT_FORK, MT_A_NONE, flags, child, 0, 0, 0);
    return 0;
}

/* mt_config[MT_CONFIG_SCOPED] = 1 when every traced process has allocator probes of
 * its own (uprobe_multi links with its pid): a new process of the tree inherits its
 * parent's breakpoints but not its links, so it is stopped as it returns from
 * fork/clone/vfork, in its own context and before any instruction of its own, and
 * userspace links it. Threads (tid != tgid) share their process's links. */
static __always_inline void mt_new_process(long ret) {
    if (ret != 0)
        return;
    u64 pt = bpf_get_current_pid_tgid();
    u32 pid = pt >> 32, tid = (u32)pt;
    if (pid != tid || !mt_is_tracked(pid))
        return;
    int k = MT_CONFIG_SCOPED;
    u64 *scoped = mt_config.lookup(&k);
    if (scoped && *scoped)
        mt_request_attach(pid, tid, MT_REQ_FORK, -1, 0, 0);
}

TRACEPOINT_PROBE(syscalls, sys_exit_clone) {
    mt_new_process(args->ret);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_clone3) {
    mt_new_process(args->ret);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_fork) {
    mt_new_process(args->ret);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_vfork) {
    mt_new_process(args->ret);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exec) {
    u64 pt = bpf_get_current_pid_tgid();
    u32 pid = pt >> 32, tid = (u32)pt;
    if (mt_pending.lookup(&pid)) {
        u8 one = 1;
        mt_tracked.update(&pid, &one);
        mt_pending.delete(&pid);
    } else if (!mt_is_tracked(pid)) {
        return 0;
    }
    mt_brk.delete(&pid);
    /* the new image starts with no allocator call and a new stack; a thread other
     * than the leader that execs takes the leader's tid and leaves its own */
    mt_thread_release(tid);
    mt_thread_release((u32)args->old_pid);
    mt_emit(pid, tid, MT_EXEC, MT_A_NONE, 0, (u32)args->old_pid, 0, 0, 0);
    mt_request_attach(pid, tid, MT_REQ_EXEC, -1, 0, (u32)args->old_pid);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit) {
    u64 pt = bpf_get_current_pid_tgid();
    u32 pid = pt >> 32, tid = (u32)pt;
    mt_thread_release(tid);
    mt_sys.delete(&tid);
    if (!mt_is_tracked(pid))
        return 0;
    u64 code = 0;
    u64 *c = mt_exitcode.lookup(&pid);
    if (c)
        code = *c;
    u64 group_dead = args->group_dead ? 1 : 0;
    mt_emit(pid, tid, MT_EXIT, MT_A_NONE, group_dead, 0, 0, code, 0);
    if (group_dead) {
        mt_tracked.delete(&pid);
        mt_exitcode.delete(&pid);
        mt_brk.delete(&pid);
    }
    return 0;
}

/* The fatal signal last generated for each tracked process (signal_generate), until
 * a handler takes it or the process's exit status is set: a fatal signal that does not
 * dump core reaches every thread as SIGKILL (the kernel makes it a group exit), so its
 * delivery shows 9 whatever the signal was. */
BPF_TABLE("lru_hash", u32, u32, mt_siggen, 65536);

static __always_inline void mt_set_exit(u64 status) {
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    if (!mt_is_tracked(pid))
        return;
    mt_exitcode.update(&pid, &status);
    mt_siggen.delete(&pid);
}

TRACEPOINT_PROBE(syscalls, sys_enter_exit_group) {
    mt_set_exit(((u64)args->error_code & 0xff) << 8);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_exit) {
    mt_set_exit(((u64)args->error_code & 0xff) << 8);
    return 0;
}

/* Whether a signal's default action ends the process (not ignore, stop, continue). */
static __always_inline int mt_sig_fatal(int sig) {
    return sig >= 1 && sig <= 64 && sig != 17 && sig != 18 && sig != 19 && sig != 20 &&
           sig != 21 && sig != 22 && sig != 23 && sig != 28;
}

/* A fatal signal taking its default action ends the process with that signal: a
 * core-dumping one is delivered as itself; any other comes as SIGKILL, the signal
 * generated for the process tells which. A SIGKILL with neither a generated signal
 * nor a status set before is a SIGKILL; with a status (exit_group's, a core dump's)
 * it is the kernel ending the other threads of a process already dying. */
TRACEPOINT_PROBE(signal, signal_deliver) {
    int sig = args->sig;
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    if (args->sa_handler != 0) {
        u32 *gen = mt_siggen.lookup(&pid);
        if (gen && *gen == (u32)sig)
            mt_siggen.delete(&pid);
        return 0;
    }
    if (!mt_sig_fatal(sig))
        return 0;
    if (sig == 9) {
        u32 *gen = mt_siggen.lookup(&pid);
        if (gen)
            sig = *gen;
        else if (mt_exitcode.lookup(&pid))
            return 0;
    }
    mt_set_exit((u64)sig);
    return 0;
}

/* A signal sent to a tracked process, by anyone (the kernel's SIGPIPE and faults come
 * from the process itself): remembered when its default action is fatal and it was
 * queued. A process-wide signal names the process by its leader (pid = tgid); one a
 * thread sends itself is keyed by its process; one sent to another thread of a
 * process is not followed. */
TRACEPOINT_PROBE(signal, signal_generate) {
    int sig = args->sig;
    /* TRACE_SIGNAL_IGNORED, TRACE_SIGNAL_OVERFLOW_FAIL: nothing will be delivered */
    if (!mt_sig_fatal(sig) || args->result == 1 || args->result == 3)
        return 0;
    u64 pt = bpf_get_current_pid_tgid();
    u32 target = (u32)args->pid;
    if (target == (u32)pt)
        target = pt >> 32;
    if (!mt_is_tracked(target))
        return 0;
    u32 s = (u32)sig;
    mt_siggen.update(&target, &s);
    return 0;
}

static __always_inline void mt_sys_enter(u64 a0, u64 a1, u64 a2, u64 a3, u64 a4) {
    u64 pt = bpf_get_current_pid_tgid();
    u32 pid = pt >> 32, tid = (u32)pt;
    if (!mt_is_tracked(pid))
        return;
    struct mt_sys_args a = {a0, a1, a2, a3, a4};
    mt_sys.update(&tid, &a);
}

/* At a syscall's exit: move the arguments stashed at its entry into *out.
 * Returns 0 when there are none (an untracked task, or entry before we attached). */
static __always_inline int mt_sys_take(u32 tid, struct mt_sys_args *out) {
    struct mt_sys_args *a = mt_sys.lookup(&tid);
    if (!a)
        return 0;
    *out = *a;
    mt_sys.delete(&tid);
    return 1;
}

TRACEPOINT_PROBE(syscalls, sys_enter_mmap) {
    u64 pt = bpf_get_current_pid_tgid();
    u32 pid = pt >> 32, tid = (u32)pt;
    if (!mt_is_tracked(pid))
        return 0;
    u64 prot = args->prot, flags = args->flags;
    s32 fd = (s32)args->fd;
    struct mt_sys_args a = {args->addr, args->len, prot, flags, (u64)(s64)fd};
    mt_sys.update(&tid, &a);
    if ((prot & MT_PROT_EXEC) && !(flags & MT_MAP_ANONYMOUS) && fd >= 0)
        mt_request_attach(pid, tid, MT_REQ_MMAP, fd, args->len, args->off);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_mmap) {
    u64 pt = bpf_get_current_pid_tgid();
    u32 pid = pt >> 32, tid = (u32)pt;
    struct mt_sys_args s;
    if (!mt_sys_take(tid, &s))
        return 0;
    s64 ret = args->ret;
    if (ret < 0 && ret > -4096)
        return 0;
    if (!mt_is_enabled())
        return 0;
    u64 fd = (s.a3 & MT_MAP_ANONYMOUS) ? (u64)-1 : s.a4;
    mt_emit(pid, tid, MT_MMAP, MT_A_SYSCALL, s.a3 | (s.a2 << 32), (u64)ret, fd, s.a1, 0);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_munmap) {
    mt_sys_enter(args->addr, args->len, 0, 0, 0);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_munmap) {
    u64 pt = bpf_get_current_pid_tgid();
    u32 pid = pt >> 32, tid = (u32)pt;
    struct mt_sys_args s;
    if (!mt_sys_take(tid, &s))
        return 0;
    if (args->ret != 0 || !mt_is_enabled())
        return 0;
    mt_emit(pid, tid, MT_MUNMAP, MT_A_SYSCALL, 0, s.a0, 0, s.a1, 0);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_brk) {
    mt_sys_enter(args->brk, 0, 0, 0, 0);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_brk) {
    u64 pt = bpf_get_current_pid_tgid();
    u32 pid = pt >> 32, tid = (u32)pt;
    struct mt_sys_args s;
    if (!mt_sys_take(tid, &s))
        return 0;
    u64 now = (u64)args->ret;
    u64 *prev = mt_brk.lookup(&pid);
    u64 before = prev ? *prev : 0;
    mt_brk.update(&pid, &now);
    /* brk(0) and failed calls leave the break where it was: nothing to report */
    if (!prev || before == now || !mt_is_enabled())
        return 0;
    mt_emit(pid, tid, MT_BRK, MT_A_SYSCALL, 0, now, before, now > before ? now - before : before - now, 0);
    return 0;
}

/* A region's begin or end, for the thread that asked on the control FIFO: run by the
 * session itself (BPF_PROG_TEST_RUN, memtrack.capture.regions) while that thread waits
 * for the answer, so the record's time, on the events' clock, falls after every event
 * the thread made before asking and before every event it makes after the answer.
 * args: pid, tid, region id, 1 = begin / 0 = end. Returns 1 when the ring is full (the
 * session retries once the drain has made room; nothing is counted lost), and writes
 * without backpressure: the caller is memtrack, which must not stop itself. */
int mt_region_mark(struct bpf_raw_tracepoint_args *ctx) {
    struct mt_event *e = mt_events.ringbuf_reserve(sizeof(struct mt_event));
    if (!e)
        return 1;
    mt_fill_event(e, (u32)ctx->args[0], (u32)ctx->args[1], MT_REGION, MT_A_NONE,
                  ctx->args[3], ctx->args[2], 0, 0, 0);
    mt_events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
    return 0;
}
