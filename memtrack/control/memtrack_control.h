/* Talk to memtrack from inside a traced program: switch recording on and off, and mark
 * regions (benchmarks, test cases). Header-only, C99 or C++, Linux, nothing but libc:
 * copy it into a benchmark's tree, or compile with -I"$(python3 -m memtrack.control)"
 * (with the default GNU dialects, or -D_GNU_SOURCE under a strict -std=).
 *
 * `memtrack capture` gives the command two FIFOs in its environment: MEMTRACK_CONTROL
 * (commands, one line each) and MEMTRACK_CONTROL_ACK (the answers, written once the
 * command is in effect in the kernel). Every call sends one command and waits for its
 * answer; it returns 0 on "ok", and -1 outside memtrack (nothing is sent), when
 * memtrack refused, or when no answer came within MEMTRACK_CONTROL_TIMEOUT_MS.
 *
 *   memtrack_enable() / memtrack_disable()   recording on / off, whole traced tree
 *   memtrack_region_begin(name)              the calling thread enters region `name`
 *   memtrack_region_end()                    ... and leaves its innermost region
 *   memtrack_region_label(key, value)        says key=value of its innermost region
 *                                            (limit.peak, ...: `memtrack check`)
 *
 * Every allocation the calling thread makes after memtrack_region_begin() returns and
 * before memtrack_region_end() is called belongs to the region; regions nest per
 * thread; other threads are not in it. A region never ended closes at its thread's
 * exit (flagged). The calls are thread-safe (an flock on the answer FIFO from command
 * to answer; each answer carries the sender's thread id) and allocate nothing. */
#ifndef MEMTRACK_CONTROL_H
#define MEMTRACK_CONTROL_H

#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef MEMTRACK_CONTROL_TIMEOUT_MS
#define MEMTRACK_CONTROL_TIMEOUT_MS 60000
#endif
#define MEMTRACK_MAX_NAME 4000 /* bytes: one command stays within one atomic write */

/* Appends the decimal digits of v at p; returns the end. */
static inline char *memtrack__digits(char *p, unsigned long v) {
    char tmp[24];
    int n = 0;
    do {
        tmp[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    while (n)
        *p++ = tmp[--n];
    return p;
}

/* Waits for the answer tagged `tag` on afd (answers to others are skipped): 0 on "ok". */
static inline int memtrack__answer(int afd, const char *tag, size_t taglen) {
    char buf[4096];
    size_t have = 0;
    struct pollfd pfd = {afd, POLLIN, 0};
    for (;;) {
        if (poll(&pfd, 1, MEMTRACK_CONTROL_TIMEOUT_MS) != 1)
            return -1;
        ssize_t r = read(afd, buf + have, sizeof buf - have);
        if (r <= 0)
            return -1;
        have += (size_t)r;
        char *line = buf, *nl;
        while ((nl = (char *)memchr(line, '\n', have - (size_t)(line - buf))) != NULL) {
            /* "ok TAG" or "error TAG why": the second word is the tag when numeric */
            char *sp = (char *)memchr(line, ' ', (size_t)(nl - line));
            char *t = sp ? sp + 1 : nl, *te = t;
            while (te < nl && *te >= '0' && *te <= '9')
                te++;
            if (te < nl && *te != ' ')
                te = t; /* not a number: untagged */
            if ((size_t)(te - t) == taglen && memcmp(t, tag, taglen) == 0)
                return nl - line >= 2 && line[0] == 'o' && line[1] == 'k' ? 0 : -1;
            line = nl + 1;
        }
        have -= (size_t)(line - buf);
        memmove(buf, line, have);
        if (have == sizeof buf)
            have = 0; /* a line longer than any answer: drop it */
    }
}

/* Sends `verb TID[ arg]` and waits for its answer. */
static inline int memtrack__request(const char *verb, const char *arg) {
    const char *ctl = getenv("MEMTRACK_CONTROL");
    const char *ack = getenv("MEMTRACK_CONTROL_ACK");
    if (!ctl || !ack)
        return -1;
    size_t vlen = strlen(verb), alen = arg ? strlen(arg) : 0;
    if (alen > MEMTRACK_MAX_NAME || (arg && memchr(arg, '\n', alen)))
        return -1;
    char line[64 + MEMTRACK_MAX_NAME];
    char *p = line;
    memcpy(p, verb, vlen);
    p += vlen;
    *p++ = ' ';
    char *tag = p;
    p = memtrack__digits(p, (unsigned long)syscall(SYS_gettid));
    size_t taglen = (size_t)(p - tag);
    if (alen) {
        *p++ = ' ';
        memcpy(p, arg, alen);
        p += alen;
    }
    *p++ = '\n';
    /* O_RDWR: the open never blocks, and a read waits for the answer instead of
     * seeing end-of-file while memtrack has no writer open. */
    int afd = open(ack, O_RDWR | O_CLOEXEC);
    if (afd < 0)
        return -1;
    int rc = -1;
    if (flock(afd, LOCK_EX) == 0) {
        int cfd = open(ctl, O_WRONLY | O_CLOEXEC);
        if (cfd >= 0) {
            ssize_t w = write(cfd, line, (size_t)(p - line));
            close(cfd);
            if (w == p - line)
                rc = memtrack__answer(afd, tag, taglen);
        }
    }
    close(afd); /* releases the lock */
    return rc;
}

static inline int memtrack_enable(void) { return memtrack__request("enable", NULL); }
static inline int memtrack_disable(void) { return memtrack__request("disable", NULL); }
static inline int memtrack_region_begin(const char *name) {
    return name && *name ? memtrack__request("begin", name) : -1;
}
static inline int memtrack_region_end(void) { return memtrack__request("end", NULL); }
static inline int memtrack_region_label(const char *key, const char *value) {
    char text[MEMTRACK_MAX_NAME + 1];
    size_t klen = key ? strlen(key) : 0, vlen = value ? strlen(value) : 0;
    if (!klen || !value || klen + 1 + vlen > MEMTRACK_MAX_NAME)
        return -1;
    memcpy(text, key, klen);
    text[klen] = '=';
    memcpy(text + klen + 1, value, vlen + 1);
    return memtrack__request("label", text);
}

#endif
