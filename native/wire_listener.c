/* The wire data path's listener: pthreads that accept framed-TCP transfers and land verified bytes in
   registered memory. No thread here ever takes the GIL; only the glue at the bottom of the file does.

   One transfer on a connection (the message is documented in transfer/wire_engine.py):
     PREFILL (a Msg naming room, layers, rows, row_bytes, ptr and ptr<i>/bytes<i> per layer)
     LAYER frames, in layer order, each at most chunk_limit data bytes
     FIRST
   answered by RESULT (Msg room, bytes) or ERROR (Msg room, body = the reason, then the connection
   is dropped). Every destination range is checked against the region table before the first byte
   lands, and again under the table's read lock for each chunk, so unregister() waits for a copy in
   progress and no copy starts into a region that is gone, or that was unregistered and registered
   again (at the same address, perhaps other memory) since the PREFILL was checked.

   Time bounds: each wait for the peer's next bytes is bounded by the receive timeout; a whole
   transfer (first byte of PREFILL to the last of FIRST) must also keep an average of at least
   min_rate bytes/s after a grace period, so a peer that dribbles a byte just inside every timeout
   (within one frame or across many tiny ones) cannot hold a connection slot for long. Between
   transfers a connection may sit idle for the idle timeout, which no rate applies to; a fresh
   connection, though, must send its first transfer's first byte within the first-byte bound (10 s by
   default, never more than the idle timeout), or it is answered ERROR and closed: a sender connects
   only to send at once, so a connection that stays silent is a port probe, a wedged peer or an attack,
   and a few of them must not hold every slot for the idle timeout.

   A new connection finding all max_conns slots taken closes the connection furthest behind the rate
   floor, counted from when that connection last began to wait or its transfer began (an idle
   connection is as far behind as it has been idle), once it is evict_after behind (1 s by default);
   a connection that has sent nothing since it was accepted holds nothing and may be closed at any
   age (else a client opening silent connections faster than max_conns a second kept every slot
   younger than evict_after and new senders out). Idle, silent or dribbling connections cannot keep
   new senders out, while a pooled connection between back-to-back items, any transfer keeping the
   rate and any connection whose bytes are already waiting are never taken. The closed connection's
   thread leaves at once (its socket is shut down); until it has, its slot counts towards none of
   max_conns, so the new connection is served in a spare slot (there are as many spares as slots).
   When no connection is that far behind, the new one is answered "listener busy" by the accept
   thread, which never blocks on it: it discards what the peer already sent, answers, shuts its side
   down and keeps draining the socket (polled with the listening one) until the peer closes or
   DRAIN_MS pass, so the peer reads the answer rather than a connection reset.

   The listener's threads run with asynchronous signals blocked: the host's signals go to its own
   threads (Python runs its handlers on the main one), and no wait here is cut short by them. A
   process forked from the host inherits the listener's memory and descriptors but not its threads;
   closing the listener there only closes that process's descriptors, leaving the parent's
   listener and connections as they are. */
#include "wire_listener.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define KIND_PREFILL 3
#define KIND_LAYER 10
#define KIND_FIRST 11
#define KIND_RESULT 20
#define KIND_ERROR 21

#define REASON_MAX 512
/* After an ERROR the connection is drained this long, so the peer reads the reason instead of a reset. */
#define DRAIN_MS 1000
/* Refused ("listener busy") connections the accept thread drains at once; more are closed at once. */
#define LINGER_MAX 64
/* Bytes the accept thread discards from one refused connection per wake-up, so others get their turn. */
#define LINGER_BUDGET ((size_t)256 << 10)
/* Default least average rate of a transfer (bytes/s): far below any real link (a 1 Gb/s link shared by
   64 connections still gives each ~1.8 MiB/s), yet a slot costs a dribbling peer this much bandwidth. */
#define DEFAULT_MIN_RATE (256.0 * 1024.0)
/* Default grace before the rate applies, in receive timeouts: two, so a peer that stops outright is
   still reported as timed out, and a sender's start-up stall is never judged a slow transfer. */
#define GRACE_TIMEOUTS 2
/* Default first-byte bound: how long a fresh connection may stay silent (capped by the idle timeout).
   A sender writes its PREFILL right after connecting, so its first byte needs a round trip and some
   scheduling; 10 s is orders of magnitude more than that, yet 30 times shorter than WireEngine's
   default idle timeout (300 s). It is not the receive timeout: that one may be set long for slow
   links, or (in tests) shorter than a sender's start-up hiccup, and neither concerns a connection
   that never began. */
#define DEFAULT_FIRST_BYTE_MS 10000
/* Default for how far behind the rate floor a connection must be before a new one may take its slot:
   far longer than a sender's pause between two items on a pooled connection, far shorter than the
   first-byte bound or a transfer's grace, which are what held slots before. */
#define DEFAULT_EVICT_AFTER_MS 1000

enum { RD_OK, RD_EOF, RD_TIMEOUT, RD_ERR, RD_SLOW };

typedef struct {
    uint64_t addr, len;
    uint64_t id; /* unique per registration: one unregistered and made again at the same address differs */
} wl_region;

struct wl_listener;

typedef struct {
    struct wl_listener *owner;
    int fd;           /* -1 once the connection closed it (under owner->lock) */
    int used;         /* a thread was started for this slot and not yet joined */
    atomic_int done;  /* the thread finished and may be joined */
    atomic_int evicted;        /* shut down to make room for a new connection */
    atomic_int silent;         /* accepted and no byte received yet: it holds nothing, so a newcomer
                                  may take its slot at any age */
    /* When the connection's progress is due at the rate floor: the start of its idle wait, or its
       transfer's start plus the time its bytes so far take at min_rate. Written by its thread,
       read by the accept thread to pick the connection furthest behind. */
    _Atomic int64_t due_ns;
    pthread_t thread;
} wl_conn;

typedef struct wl_listener {
    int lfd;
    int wake[2];
    int port;
    int started; /* the accept thread runs */
    atomic_int closed;
    pthread_mutex_t close_lock; /* held for a whole close: a second closer returns once it is done */
    atomic_int stopping;
    pthread_t accept_thread;
    pid_t pid; /* the process that started the threads; a forked child only closes its descriptors */
    int recv_timeout_ms, idle_timeout_ms;
    int first_byte_ms; /* how long a fresh connection may wait before its first byte */
    double min_rate;  /* least average bytes/s of a transfer after the grace; 0: no rate bound */
    int64_t grace_ns; /* how long a transfer runs before min_rate applies */
    size_t chunk_limit;
    int max_conns;
    int nslots;              /* max_conns and as many spares for connections still leaving */
    int64_t evict_after_ns;  /* how far behind a connection may be closed for a new one; <0: never */
    wl_conn *conns;
    /* Refused connections still being drained; only the accept thread touches these. */
    int linger_fd[LINGER_MAX];
    int64_t linger_until[LINGER_MAX];
    int nlinger;
    pthread_rwlock_t regions_lock;
    wl_region *regions;
    size_t nregions, cap;
    uint64_t next_region_id; /* under the write lock */
    pthread_mutex_t lock; /* conns' fds and the counters below */
    unsigned long long accepted, refused, transfers, failures, bytes, too_slow;
    unsigned long long silent; /* fresh connections closed for sending nothing within first_byte_ms */
    unsigned long long evicted; /* connections closed to make room for a new one */
    int active;
    char last_error[REASON_MAX];
} wl_listener;

/* A connection's reading side: its socket and the clock of the transfer being read. */
typedef struct {
    int fd;
    int64_t start_ns; /* when the transfer's first byte was there */
    uint64_t got;     /* bytes of the transfer received so far, headers included */
    wl_conn *conn;    /* where its progress is published for eviction */
} wl_io;

/* One transfer's announced shape, parsed from the PREFILL Msg. */
typedef struct {
    uint64_t room, rows, row_bytes, ptr;
    int room_known;
    unsigned layers;
    uint64_t lptr[EPD_WIRE_MAX_LAYERS], lbytes[EPD_WIRE_MAX_LAYERS];
    uint64_t lregion[EPD_WIRE_MAX_LAYERS]; /* the registration each layer's destination lay in when checked */
} wl_prefill;

/* ------------------------------------------------------------------ region table */

/* The id of the region [addr, addr + len) (len > 0) lies wholly inside, or 0 when none; caller holds
   the read lock. */
static uint64_t region_covering(const wl_listener *l, uint64_t addr, uint64_t len)
{
    if (addr + len < addr)
        return 0;
    for (size_t i = 0; i < l->nregions; i++) {
        const wl_region *r = &l->regions[i];
        if (addr >= r->addr && addr + len <= r->addr + r->len)
            return r->id;
    }
    return 0;
}

/* Adds a region; 0, or -1 with a reason when it is empty, wraps, or overlaps another. */
static int regions_add(wl_listener *l, uint64_t addr, uint64_t len, char *why, size_t whylen)
{
    int rc = 0;
    pthread_rwlock_wrlock(&l->regions_lock);
    for (size_t i = 0; i < l->nregions; i++) {
        const wl_region *r = &l->regions[i];
        if (addr < r->addr + r->len && r->addr < addr + len) {
            snprintf(why, whylen, "region 0x%llx+%llu overlaps the registered region 0x%llx+%llu",
                     (unsigned long long)addr, (unsigned long long)len, (unsigned long long)r->addr,
                     (unsigned long long)r->len);
            rc = -1;
            break;
        }
    }
    if (rc == 0 && l->nregions == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 16;
        wl_region *grown = realloc(l->regions, cap * sizeof *grown);
        if (grown == NULL) {
            snprintf(why, whylen, "out of memory growing the region table");
            rc = -1;
        } else {
            l->regions = grown;
            l->cap = cap;
        }
    }
    if (rc == 0)
        l->regions[l->nregions++] = (wl_region){addr, len, ++l->next_region_id};
    pthread_rwlock_unlock(&l->regions_lock);
    return rc;
}

/* Removes the region starting at addr once no copy into it runs; its length, or -1 when unknown. */
static long long regions_remove(wl_listener *l, uint64_t addr)
{
    long long len = -1;
    pthread_rwlock_wrlock(&l->regions_lock);
    for (size_t i = 0; i < l->nregions; i++) {
        if (l->regions[i].addr == addr) {
            len = (long long)l->regions[i].len;
            l->regions[i] = l->regions[--l->nregions];
            break;
        }
    }
    pthread_rwlock_unlock(&l->regions_lock);
    return len;
}

/* --------------------------------------------------------------------- socket I/O */

/* CLOCK_MONOTONIC in nanoseconds. */
static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Nanoseconds the transfer may have taken once it has received `got` bytes: the grace plus the time
   those bytes take at min_rate (capped far beyond any real wait, so it never overflows). */
static int64_t allowed_ns(const wl_listener *l, uint64_t got)
{
    double ns = (double)l->grace_ns + (double)got / l->min_rate * 1e9;
    return ns < 1e18 ? (int64_t)ns : (int64_t)1e18;
}

/* Publishes when the transfer's progress so far is due at the rate floor (with no floor: now). */
static void publish_due(const wl_listener *l, wl_io *io)
{
    int64_t due = now_ns();
    if (l->min_rate > 0) {
        double ns = (double)io->got / l->min_rate * 1e9;
        due = io->start_ns + (ns < 1e18 ? (int64_t)ns : (int64_t)1e18);
    }
    atomic_store_explicit(&io->conn->due_ns, due, memory_order_relaxed);
}

/* Poll milliseconds until `end` (monotonic ns), rounded up so that a wait ends past it; 0 once
   it is past. */
static int ms_until(int64_t end)
{
    int64_t left = end - now_ns();
    return left <= 0 ? 0 : (int)((left + 999999) / 1000000);
}

/* Waits until the socket is readable, then receives up to n bytes into *k. A wait is bounded by the
   receive timeout (RD_TIMEOUT) and by the transfer's rate deadline (RD_SLOW); both are absolute, so
   a signal that interrupts a wait does not start it over. */
static int recv_some(wl_listener *l, wl_io *io, void *buf, size_t n, size_t *k)
{
    int64_t quiet_end = now_ns() + (int64_t)l->recv_timeout_ms * 1000000;
    for (;;) {
        int wait_ms = ms_until(quiet_end), by_rate = 0;
        if (l->min_rate > 0) {
            int64_t left = io->start_ns + allowed_ns(l, io->got) - now_ns();
            if (left < (int64_t)wait_ms * 1000000) {
                /* Past the deadline, bytes already here are still taken (this thread may have been the
                   slow one); a peer below the rate is cut the first time none are. Rounded up, a wait
                   ends past the deadline. */
                wait_ms = left <= 0 ? 0 : (int)((left + 999999) / 1000000);
                by_rate = 1;
            }
        }
        struct pollfd pfd = {.fd = io->fd, .events = POLLIN};
        int r = poll(&pfd, 1, wait_ms);
        if (r == 0 && by_rate) {
            pthread_mutex_lock(&l->lock);
            l->too_slow++;
            pthread_mutex_unlock(&l->lock);
            return RD_SLOW;
        }
        if (r == 0)
            return RD_TIMEOUT;
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return RD_ERR;
        }
        ssize_t got = recv(io->fd, buf, n, 0);
        if (got == 0)
            return RD_EOF;
        if (got < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)
                continue;
            return RD_ERR;
        }
        *k = (size_t)got;
        io->got += (uint64_t)got;
        publish_due(l, io);
        return RD_OK;
    }
}

/* Reads exactly n bytes, each wait bounded as recv_some says. */
static int read_all(wl_listener *l, wl_io *io, void *buf, size_t n, size_t *got)
{
    char *p = buf;
    *got = 0;
    while (*got < n) {
        size_t k;
        int rc = recv_some(l, io, p + *got, n - *got, &k);
        if (rc != RD_OK)
            return rc;
        *got += k;
    }
    return RD_OK;
}

/* read_all that also sums the bytes as they arrive, while they are still in cache: whole words are
   summed as soon as they are complete (offsets stay multiples of 8 from the start, so the partial
   sums add up to epd_layer_sum of the whole), the zero-padded tail at the end. */
static int read_summed(wl_listener *l, wl_io *io, unsigned char *buf, size_t n, size_t *got, uint64_t *sum)
{
    size_t summed = 0;
    uint64_t acc = 0;
    *got = 0;
    while (*got < n) {
        size_t k;
        int rc = recv_some(l, io, buf + *got, n - *got, &k);
        if (rc != RD_OK)
            return rc;
        *got += k;
        size_t whole = *got & ~(size_t)7;
        if (whole > summed) {
            acc += epd_layer_sum(buf + summed, whole - summed);
            summed = whole;
        }
    }
    if (summed < n)
        acc += epd_layer_sum(buf + summed, n - summed);
    *sum = acc;
    return RD_OK;
}

/* Sends every byte (SO_SNDTIMEO bounds a stuck peer; MSG_NOSIGNAL keeps SIGPIPE away); 0 or -1. */
static int send_all(int fd, const void *buf, size_t n)
{
    const char *p = buf;
    while (n > 0) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

/* Room for one reply frame: the 5-byte header, a Msg's few header lines, a reason. */
#define REPLY_MAX (5 + REASON_MAX + 128)

/* Encodes one frame whose payload is a Msg with `room` (when known) and an optional extra field into
   out (REPLY_MAX bytes); its length, or -1. */
static int format_reply(unsigned char *out, unsigned kind, const wl_prefill *pf, const char *extra_key,
                        uint64_t extra, const char *body)
{
    char extra_line[64] = "", room_line[40] = "";
    /* Keys in sorted order, as every Msg encodes them: "bytes" < "room". */
    if (extra_key != NULL)
        snprintf(extra_line, sizeof extra_line, "%s=%llu\n", extra_key, (unsigned long long)extra);
    if (pf->room_known)
        snprintf(room_line, sizeof room_line, "room=%llu\n", (unsigned long long)pf->room);
    char *msg = (char *)out + EPD_FRAME_HEADER;
    size_t room = REPLY_MAX - EPD_FRAME_HEADER;
    int n = snprintf(msg, room, "%s%s\n%s", extra_line, room_line, body ? body : "");
    if (n < 0)
        return -1;
    if ((size_t)n >= room)
        n = (int)room - 1; /* a reason is at most REASON_MAX bytes, so this never cuts one */
    epd_put_frame_header(out, (size_t)n, kind);
    return n + EPD_FRAME_HEADER;
}

/* Sends one reply frame (see format_reply) in a single send: a frame split over two sends could
   leave its tail unsent behind Nagle when a reset follows, and the peer would read half an answer. */
static int send_reply(int fd, unsigned kind, const wl_prefill *pf, const char *extra_key, uint64_t extra,
                      const char *body)
{
    unsigned char frame[REPLY_MAX];
    int n = format_reply(frame, kind, pf, extra_key, extra, body);
    return n < 0 ? -1 : send_all(fd, frame, (size_t)n);
}

/* Tells the peer why (best effort), stops our sending side and drains briefly, so the reason is
   read rather than lost to a connection reset. */
static void answer_error(wl_listener *l, int fd, const wl_prefill *pf, const char *why)
{
    if (send_reply(fd, KIND_ERROR, pf, NULL, 0, why) < 0)
        return;
    shutdown(fd, SHUT_WR);
    char sink[65536];
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        clock_gettime(CLOCK_MONOTONIC, &t1);
        long ms = (t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000;
        if (ms >= DRAIN_MS || atomic_load(&l->stopping))
            return;
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int r = poll(&pfd, 1, (int)(DRAIN_MS - ms));
        if (r <= 0)
            return;
        if (recv(fd, sink, sizeof sink, 0) <= 0)
            return;
    }
}

/* Refuses a transfer: counts it, keeps its reason for stats, and answers it (answer_error). */
static void refuse(wl_listener *l, int fd, const wl_prefill *pf, const char *fmt, ...)
{
    char why[REASON_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&l->lock);
    l->failures++;
    snprintf(l->last_error, sizeof l->last_error, "%s", why);
    pthread_mutex_unlock(&l->lock);
    answer_error(l, fd, pf, why);
}

/* Words for a failed read in a reason, written into buf; returns buf. */
static const char *read_failure(const wl_listener *l, const wl_io *io, int rc, char *buf, size_t len)
{
    if (atomic_load(&io->conn->evicted) && (rc == RD_EOF || rc == RD_ERR)) {
        snprintf(buf, len,
                 "closed by the listener for a new connection: every slot was taken and this transfer "
                 "(%llu bytes in %.2f s) was furthest behind the least rate of %.0f bytes/s",
                 (unsigned long long)io->got, (double)(now_ns() - io->start_ns) / 1e9, l->min_rate);
        return buf;
    }
    switch (rc) {
    case RD_EOF:
        snprintf(buf, len, "the peer closed the connection");
        break;
    case RD_TIMEOUT:
        snprintf(buf, len, "timed out waiting for the peer");
        break;
    case RD_SLOW:
        snprintf(buf, len,
                 "the peer is too slow (%llu bytes of this transfer in %.2f s; a transfer must average at least "
                 "%.0f bytes/s after its first %.2f s)",
                 (unsigned long long)io->got, (double)(now_ns() - io->start_ns) / 1e9, l->min_rate,
                 (double)l->grace_ns / 1e9);
        break;
    default:
        snprintf(buf, len, "%s", strerror(errno));
        break;
    }
    return buf;
}

/* ------------------------------------------------------------------- PREFILL Msg */

/* Finds the last header line `key=...`; the value's start and length, or NULL when absent. */
static const char *msg_find(const char *msg, size_t hlen, const char *key, size_t *vlen)
{
    size_t klen = strlen(key);
    const char *found = NULL;
    size_t at = 0;
    while (at < hlen) {
        const char *nl = memchr(msg + at, '\n', hlen - at);
        size_t end = nl ? (size_t)(nl - msg) : hlen;
        if (end - at > klen && memcmp(msg + at, key, klen) == 0 && msg[at + klen] == '=') {
            found = msg + at + klen + 1;
            *vlen = end - at - klen - 1;
        }
        at = end + 1;
    }
    return found;
}

/* Reads field `key` as a u64 decimal (an optional sign, ASCII digits: Msg.number's grammar; a
   negative number other than -0 is not a u64); 0, or -1 with SPEC.md's words. */
static int msg_u64(const char *msg, size_t hlen, const char *key, uint64_t *out, char *why, size_t whylen)
{
    size_t n;
    const char *v = msg_find(msg, hlen, key, &n);
    if (v == NULL) {
        snprintf(why, whylen, "PREFILL: missing %s", key);
        return -1;
    }
    int negative = n > 0 && v[0] == '-';
    if (n > 0 && (v[0] == '+' || v[0] == '-')) {
        v++;
        n--;
    }
    uint64_t x = 0;
    int ok = n > 0;
    for (size_t i = 0; ok && i < n; i++) {
        unsigned d = (unsigned char)v[i] - '0';
        if (d > 9 || x > (UINT64_MAX - d) / 10)
            ok = 0;
        else
            x = x * 10 + d;
    }
    if (!ok || (negative && x != 0)) {
        snprintf(why, whylen, "PREFILL: %s: not a number", key);
        return -1;
    }
    *out = x;
    return 0;
}

/* Whether s[0..n) is UTF-8 as CPython's strict decoder takes it (no overlong forms, surrogates
   or code points past U+10FFFF). */
static int utf8_valid(const unsigned char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t len;
        unsigned lo = 0x80, hi = 0xBF; /* the second byte's range */
        if (c >= 0xC2 && c <= 0xDF) {
            len = 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            len = 3;
            lo = c == 0xE0 ? 0xA0 : 0x80;
            hi = c == 0xED ? 0x9F : 0xBF;
        } else if (c >= 0xF0 && c <= 0xF4) {
            len = 4;
            lo = c == 0xF0 ? 0x90 : 0x80;
            hi = c == 0xF4 ? 0x8F : 0xBF;
        } else {
            return 0;
        }
        if (n - i < len || s[i + 1] < lo || s[i + 1] > hi)
            return 0;
        for (size_t k = 2; k < len; k++)
            if (s[i + k] < 0x80 || s[i + k] > 0xBF)
                return 0;
        i += len;
    }
    return 1;
}

/* Checks the header as Msg.decode does (UTF-8, every line `key=value`); 0, or -1 with SPEC.md's words. */
static int msg_header_valid(const char *msg, size_t hlen, char *why, size_t whylen)
{
    if (!utf8_valid((const unsigned char *)msg, hlen)) {
        snprintf(why, whylen, "PREFILL: a message that is not UTF-8");
        return -1;
    }
    size_t at = 0;
    while (at < hlen) {
        const char *nl = memchr(msg + at, '\n', hlen - at);
        size_t end = nl ? (size_t)(nl - msg) : hlen;
        if (memchr(msg + at, '=', end - at) == NULL) {
            size_t shown = end - at < 64 ? end - at : 64;
            while (shown > 0 && shown < end - at && ((unsigned char)msg[at + shown] & 0xC0) == 0x80)
                shown--; /* the quote ends on a whole UTF-8 character */
            snprintf(why, whylen, "PREFILL: a header line without '=': \"%.*s%s\"", (int)shown, msg + at,
                     end - at > 64 ? "..." : "");
            return -1;
        }
        at = end + 1;
    }
    return 0;
}

/* Parses and checks the announced shape (not yet the destinations); 0, or -1 with a reason. */
static int parse_prefill(const char *msg, size_t n, wl_prefill *pf, char *why, size_t whylen)
{
    /* The header ends where msg_decode ends it: a leading newline (an empty header) or the
       first blank line; with neither, the whole message is header. */
    size_t hlen = n;
    if (n > 0 && msg[0] == '\n') {
        hlen = 0;
    } else {
        for (size_t i = 0; i + 1 < n; i++) {
            if (msg[i] == '\n' && msg[i + 1] == '\n') {
                hlen = i + 1;
                break;
            }
        }
    }
    if (msg_header_valid(msg, hlen, why, whylen) < 0 || msg_u64(msg, hlen, "room", &pf->room, why, whylen) < 0)
        return -1;
    pf->room_known = 1;
    uint64_t layers;
    if (msg_u64(msg, hlen, "layers", &layers, why, whylen) < 0 ||
        msg_u64(msg, hlen, "rows", &pf->rows, why, whylen) < 0 ||
        msg_u64(msg, hlen, "row_bytes", &pf->row_bytes, why, whylen) < 0 ||
        msg_u64(msg, hlen, "ptr", &pf->ptr, why, whylen) < 0)
        return -1;
    if (layers < 1 || layers > EPD_WIRE_MAX_LAYERS) {
        snprintf(why, whylen, "PREFILL announces %llu layers; 1..%d are allowed", (unsigned long long)layers,
                 EPD_WIRE_MAX_LAYERS);
        return -1;
    }
    if (pf->rows > UINT32_MAX) {
        snprintf(why, whylen, "PREFILL: rows %llu does not fit the LAYER header's u32", (unsigned long long)pf->rows);
        return -1;
    }
    pf->layers = (unsigned)layers;
    for (unsigned i = 0; i < pf->layers; i++) {
        char key[16];
        snprintf(key, sizeof key, "ptr%u", i);
        if (msg_u64(msg, hlen, key, &pf->lptr[i], why, whylen) < 0)
            return -1;
        snprintf(key, sizeof key, "bytes%u", i);
        if (msg_u64(msg, hlen, key, &pf->lbytes[i], why, whylen) < 0)
            return -1;
        /* Our senders never send an empty layer; one would need no registered destination, so
           repeating it would let any peer keep a slot busy for ever. */
        if (pf->lbytes[i] == 0) {
            snprintf(why, whylen, "PREFILL: layer %u announces 0 bytes; every layer must carry some", i);
            return -1;
        }
    }
    uint64_t want;
    if (__builtin_mul_overflow(pf->rows, pf->row_bytes, &want)) {
        snprintf(why, whylen, "PREFILL: rows %llu x row_bytes %llu overflows", (unsigned long long)pf->rows,
                 (unsigned long long)pf->row_bytes);
        return -1;
    }
    if (want != pf->lbytes[0]) {
        snprintf(why, whylen, "PREFILL: rows %llu x row_bytes %llu = %llu but bytes0 is %llu",
                 (unsigned long long)pf->rows, (unsigned long long)pf->row_bytes, (unsigned long long)want,
                 (unsigned long long)pf->lbytes[0]);
        return -1;
    }
    if (pf->ptr != pf->lptr[0]) {
        snprintf(why, whylen, "PREFILL: ptr 0x%llx differs from ptr0 0x%llx", (unsigned long long)pf->ptr,
                 (unsigned long long)pf->lptr[0]);
        return -1;
    }
    for (unsigned i = 1; i < pf->layers; i++) {
        if (pf->rows > 0 && pf->lbytes[i] % pf->rows != 0) {
            snprintf(why, whylen, "PREFILL: bytes%u = %llu is not a multiple of rows %llu", i,
                     (unsigned long long)pf->lbytes[i], (unsigned long long)pf->rows);
            return -1;
        }
    }
    return 0;
}

/* Checks every layer's destination against the region table; 0, or -1 with a reason naming the range. */
static int check_destinations(wl_listener *l, wl_prefill *pf, char *why, size_t whylen)
{
    int rc = 0;
    pthread_rwlock_rdlock(&l->regions_lock);
    for (unsigned i = 0; i < pf->layers && rc == 0; i++) {
        uint64_t p = pf->lptr[i], n = pf->lbytes[i];
        if (n == 0)
            continue;
        if (p + n < p) {
            snprintf(why, whylen, "layer %u: destination 0x%llx + %llu bytes wraps around the address space", i,
                     (unsigned long long)p, (unsigned long long)n);
            rc = -1;
        } else if ((pf->lregion[i] = region_covering(l, p, n)) == 0) {
            snprintf(why, whylen, "layer %u: destination [0x%llx, 0x%llx) (%llu bytes) is not inside registered memory",
                     i, (unsigned long long)p, (unsigned long long)(p + n), (unsigned long long)n);
            rc = -1;
        }
    }
    pthread_rwlock_unlock(&l->regions_lock);
    return rc;
}

/* ------------------------------------------------------------------- one transfer */

/* Outcome of serve_one: go on with the next transfer, or drop the connection. */
enum { SERVE_AGAIN, SERVE_DROP };

/* Reads a frame header (u32 length, u8 kind); the payload length, or -1 after refusing the peer. */
static long long read_header(wl_listener *l, wl_io *io, const wl_prefill *pf, unsigned *kind, const char *when)
{
    const int fd = io->fd;
    char fail[REASON_MAX / 2];
    unsigned char h[5];
    size_t got;
    int rc = read_all(l, io, h, 4, &got);
    if (rc == RD_OK && epd_get_le32(h) == 0) {
        refuse(l, fd, pf, "read: zero-length frame has no kind byte (%s)", when);
        return -1;
    }
    if (rc == RD_OK) {
        rc = read_all(l, io, h + 4, 1, &got);
        got += 4;
    }
    if (rc != RD_OK) {
        refuse(l, fd, pf, "read: %s %s (%zu of 5 header bytes)", read_failure(l, io, rc, fail, sizeof fail), when,
               got);
        return -1;
    }
    *kind = h[4];
    return (long long)epd_get_le32(h) - 1;
}

/* Reads and discards a small control payload (FIRST's); 0, or -1 after refusing the peer. */
static int skip_control(wl_listener *l, wl_io *io, const wl_prefill *pf, size_t n)
{
    const int fd = io->fd;
    char buf[512], fail[REASON_MAX / 2];
    if (n > EPD_WIRE_MAX_CONTROL) {
        refuse(l, fd, pf, "FIRST payload of %zu bytes exceeds the limit of %zu bytes", n, EPD_WIRE_MAX_CONTROL);
        return -1;
    }
    while (n > 0) {
        size_t take = n < sizeof buf ? n : sizeof buf, got;
        int rc = read_all(l, io, buf, take, &got);
        if (rc != RD_OK) {
            refuse(l, fd, pf, "read: %s inside FIRST", read_failure(l, io, rc, fail, sizeof fail));
            return -1;
        }
        n -= take;
    }
    return 0;
}

/* Receives one LAYER frame's data into the bounce buffer, verifies it, and copies it into place. */
static int land_chunk(wl_listener *l, wl_io *io, const wl_prefill *pf, unsigned layer, uint64_t *done,
                      size_t plen, unsigned char *bounce)
{
    const int fd = io->fd;
    char fail[REASON_MAX / 2];
    unsigned char lh[EPD_LAYER_HEADER];
    size_t got;
    if (plen < EPD_LAYER_HEADER) {
        refuse(l, fd, pf, "LAYER payload shorter than its %d-byte header: %zu bytes", EPD_LAYER_HEADER, plen);
        return -1;
    }
    size_t dlen = plen - EPD_LAYER_HEADER;
    uint64_t left = pf->lbytes[layer] - *done;
    /* Every size is judged before reading the data, so a lying frame costs no memory. */
    if (dlen > l->chunk_limit) {
        refuse(l, fd, pf, "LAYER frame of %zu data bytes exceeds the chunk limit of %zu bytes", dlen, l->chunk_limit);
        return -1;
    }
    if (dlen == 0) {
        refuse(l, fd, pf, "empty LAYER frame in layer %u", layer);
        return -1;
    }
    if (dlen > left) {
        refuse(l, fd, pf, "layer %u overruns its announced %llu bytes: %llu received + %zu in this frame", layer,
               (unsigned long long)pf->lbytes[layer], (unsigned long long)*done, dlen);
        return -1;
    }
    int rc = read_all(l, io, lh, sizeof lh, &got);
    if (rc != RD_OK) {
        refuse(l, fd, pf, "read: %s inside a LAYER header of layer %u", read_failure(l, io, rc, fail, sizeof fail),
               layer);
        return -1;
    }
    uint32_t flayer = epd_get_le32(lh), frows = epd_get_le32(lh + 4);
    uint64_t want = epd_get_le64(lh + 8);
    if (flayer != layer) {
        refuse(l, fd, pf, "LAYER frame for layer %u while layer %u has %llu of %llu bytes", flayer, layer,
               (unsigned long long)*done, (unsigned long long)pf->lbytes[layer]);
        return -1;
    }
    if (frows != pf->rows) {
        refuse(l, fd, pf, "LAYER frame of layer %u says %u rows; PREFILL announced %llu", layer, frows,
               (unsigned long long)pf->rows);
        return -1;
    }
    uint64_t sum;
    rc = read_summed(l, io, bounce, dlen, &got, &sum);
    if (rc != RD_OK) {
        refuse(l, fd, pf, "read: %s mid-frame in layer %u after %zu of %zu data bytes",
               read_failure(l, io, rc, fail, sizeof fail), layer, got, dlen);
        return -1;
    }
    if (sum != want) {
        refuse(l, fd, pf, "LAYER checksum mismatch in layer %u at offset %llu: header 0x%016llx, computed 0x%016llx",
               layer, (unsigned long long)*done, (unsigned long long)want, (unsigned long long)sum);
        return -1;
    }
    uint64_t dst = pf->lptr[layer] + *done;
    /* The read lock holds unregister() off for exactly the copy, which lands only in the registration
       checked at the PREFILL: memory unregistered meanwhile and registered again is someone else's. */
    pthread_rwlock_rdlock(&l->regions_lock);
    int inside = dlen == 0 || region_covering(l, dst, dlen) == pf->lregion[layer];
    if (inside)
        memcpy((void *)(uintptr_t)dst, bounce, dlen);
    pthread_rwlock_unlock(&l->regions_lock);
    if (!inside) {
        refuse(l, fd, pf, "layer %u: destination [0x%llx, 0x%llx) was unregistered during the transfer", layer,
               (unsigned long long)dst, (unsigned long long)(dst + dlen));
        return -1;
    }
    *done += dlen;
    return 0;
}

/* Serves one transfer whose PREFILL header was read; SERVE_AGAIN after a RESULT. */
static int serve_transfer(wl_listener *l, wl_io *io, unsigned kind, size_t plen, unsigned char **bounce)
{
    const int fd = io->fd;
    wl_prefill pf = {0};
    char why[REASON_MAX], fail[REASON_MAX / 2];
    if (kind != KIND_PREFILL) {
        refuse(l, fd, &pf, "expected a PREFILL frame, got kind %u", kind);
        return SERVE_DROP;
    }
    if (plen > EPD_WIRE_MAX_CONTROL) {
        refuse(l, fd, &pf, "PREFILL payload of %zu bytes exceeds the limit of %zu bytes", plen, EPD_WIRE_MAX_CONTROL);
        return SERVE_DROP;
    }
    char *msg = malloc(plen + 1);
    size_t got;
    if (msg == NULL) {
        refuse(l, fd, &pf, "out of memory reading a PREFILL of %zu bytes", plen);
        return SERVE_DROP;
    }
    int rc = read_all(l, io, msg, plen, &got);
    if (rc != RD_OK) {
        free(msg);
        refuse(l, fd, &pf, "read: %s inside PREFILL after %zu of %zu bytes", read_failure(l, io, rc, fail, sizeof fail),
               got, plen);
        return SERVE_DROP;
    }
    rc = parse_prefill(msg, plen, &pf, why, sizeof why);
    free(msg);
    if (rc < 0 || check_destinations(l, &pf, why, sizeof why) < 0) {
        refuse(l, fd, &pf, "%s", why);
        return SERVE_DROP;
    }
    uint64_t total = 0;
    for (unsigned i = 0; i < pf.layers; i++) {
        uint64_t done = 0;
        while (done < pf.lbytes[i]) {
            long long n = read_header(l, io, &pf, &kind, "inside a transfer");
            if (n < 0)
                return SERVE_DROP;
            if (kind != KIND_LAYER) {
                refuse(l, fd, &pf, "%s frame (kind %u) with layer %u at %llu of %llu bytes",
                       kind == KIND_FIRST ? "early FIRST" : "unexpected", kind, i, (unsigned long long)done,
                       (unsigned long long)pf.lbytes[i]);
                return SERVE_DROP;
            }
            if (*bounce == NULL && (*bounce = malloc(l->chunk_limit)) == NULL) {
                refuse(l, fd, &pf, "out of memory for a %zu-byte bounce buffer", l->chunk_limit);
                return SERVE_DROP;
            }
            if (land_chunk(l, io, &pf, i, &done, (size_t)n, *bounce) < 0)
                return SERVE_DROP;
        }
        total += done;
    }
    long long n = read_header(l, io, &pf, &kind, "waiting for FIRST");
    if (n < 0)
        return SERVE_DROP;
    if (kind != KIND_FIRST) {
        refuse(l, fd, &pf, "%s frame (kind %u) after all %llu announced bytes; expected FIRST",
               kind == KIND_LAYER ? "LAYER data beyond the announced total: a LAYER" : "unexpected", kind,
               (unsigned long long)total);
        return SERVE_DROP;
    }
    if (skip_control(l, io, &pf, (size_t)n) < 0)
        return SERVE_DROP;
    pthread_mutex_lock(&l->lock);
    l->transfers++;
    l->bytes += total;
    pthread_mutex_unlock(&l->lock);
    if (send_reply(fd, KIND_RESULT, &pf, "bytes", total, NULL) < 0)
        return SERVE_DROP;
    return SERVE_AGAIN;
}

/* Outcome of wait_for_transfer. */
enum { WAIT_BYTES, WAIT_TIMEOUT, WAIT_STOP };

/* Waits up to wait_ms for the next transfer's first byte (or the peer's hang-up); a signal that
   interrupts the wait does not start it over. */
static int wait_for_transfer(wl_listener *l, int fd, int wait_ms)
{
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    int64_t end = now_ns() + (int64_t)wait_ms * 1000000;
    for (;;) {
        int r = poll(&pfd, 1, ms_until(end));
        if (r > 0)
            return atomic_load(&l->stopping) ? WAIT_STOP : WAIT_BYTES;
        if (r == 0)
            return WAIT_TIMEOUT;
        if (errno != EINTR)
            return WAIT_STOP;
    }
}

/* Closes out a fresh connection that sent nothing within the first-byte bound: counts it, keeps the
   reason for stats (no transfer was refused, so `failures` stays as it is) and tells the peer. */
static void drop_silent(wl_listener *l, int fd)
{
    wl_prefill none = {0};
    char why[REASON_MAX];
    snprintf(why, sizeof why,
             "read: nothing received within %.2f s of connecting (the first-byte bound); connection closed",
             (double)l->first_byte_ms / 1e3);
    pthread_mutex_lock(&l->lock);
    l->silent++;
    snprintf(l->last_error, sizeof l->last_error, "%s", why);
    pthread_mutex_unlock(&l->lock);
    answer_error(l, fd, &none, why);
}

/* A connection's thread: transfers back to back until the peer leaves, lies, or we stop. */
static void *conn_main(void *arg)
{
    pthread_setname_np(pthread_self(), "epd-wire-conn"); /* in top -H and /proc: the wire's transport */
    wl_conn *c = arg;
    wl_listener *l = c->owner;
    int fd = c->fd;
    wl_io io = {.fd = fd, .conn = c};
    unsigned char *bounce = NULL;
    /* Until its first transfer begins, a connection holds a slot on nothing but a connect: the short
       first-byte bound applies. Once one completed, it is a pooled sender connection, legitimately
       idle between items for up to the idle timeout. */
    int fresh = 1;
    while (!atomic_load(&l->stopping)) {
        atomic_store_explicit(&c->due_ns, now_ns(), memory_order_relaxed); /* idle from now */
        int waited = wait_for_transfer(l, fd, fresh ? l->first_byte_ms : l->idle_timeout_ms);
        if (atomic_load(&c->evicted))
            break; /* shut down for a new connection: nothing to tell the peer */
        if (waited == WAIT_TIMEOUT && fresh)
            drop_silent(l, fd);
        if (waited != WAIT_BYTES)
            break;
        atomic_store(&c->silent, 0); /* before its bytes are taken: see evict_furthest_behind */
        char first;
        ssize_t k = recv(fd, &first, 1, MSG_PEEK | MSG_DONTWAIT);
        if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
            break; /* the peer closed or reset an idle connection: no transfer, so not a refused one */
        /* The transfer's clock starts with its first byte: the idle wait before it is not the peer's
           slowness. */
        io.start_ns = now_ns();
        io.got = 0;
        publish_due(l, &io);
        wl_prefill none = {0};
        unsigned kind;
        long long n = read_header(l, &io, &none, &kind, "at the start of a transfer");
        if (n < 0)
            break;
        if (serve_transfer(l, &io, kind, (size_t)n, &bounce) != SERVE_AGAIN)
            break;
        fresh = 0;
    }
    free(bounce);
    pthread_mutex_lock(&l->lock);
    close(fd);
    c->fd = -1;
    l->active--;
    pthread_mutex_unlock(&l->lock);
    atomic_store(&c->done, 1);
    return NULL;
}

/* ------------------------------------------------------------------ accepting */

/* Joins the threads of finished connections so their slots can be reused. */
static void reap(wl_listener *l)
{
    for (int i = 0; i < l->nslots; i++) {
        wl_conn *c = &l->conns[i];
        if (c->used && atomic_load(&c->done)) {
            pthread_join(c->thread, NULL);
            c->used = 0;
        }
    }
}

/* Discards up to `budget` bytes the peer sent, without blocking; 1 once the peer closed (or the socket
   failed), 0 while it is still open. */
static int drain_now(int fd, size_t budget)
{
    char sink[65536];
    while (budget > 0) {
        ssize_t k = recv(fd, sink, sizeof sink, MSG_DONTWAIT);
        if (k == 0)
            return 1;
        if (k < 0)
            return errno == EINTR ? 0 : !(errno == EAGAIN || errno == EWOULDBLOCK);
        budget -= (size_t)k < budget ? (size_t)k : budget;
    }
    return 0;
}

/* Closes a refused connection after discarding what it still holds: closing with unread bytes would
   make the kernel send a reset, which can overtake our answer. */
static void close_drained(int fd)
{
    drain_now(fd, LINGER_BUDGET);
    close(fd);
}

/* Turns a connection away (counted in `refused`) with an ERROR saying why, without blocking this (the
   accept) thread: discards what the peer already sent, sends the answer in one segment, shuts our side
   down, then leaves the socket to accept_main's poll to drain until the peer closes or DRAIN_MS pass. */
static void refuse_connection(wl_listener *l, int fd, const char *why)
{
    wl_prefill none = {0};
    unsigned char frame[REPLY_MAX];
    pthread_mutex_lock(&l->lock);
    l->refused++;
    pthread_mutex_unlock(&l->lock);
    int one = 1, flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
        close(fd); /* cannot make it non-blocking: not worth risking a stall of the accept thread */
        return;
    }
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (drain_now(fd, LINGER_BUDGET)) {
        close(fd); /* the peer is gone already */
        return;
    }
    int n = format_reply(frame, KIND_ERROR, &none, NULL, 0, why);
    /* A fresh socket's send buffer takes these few hundred bytes whole; if not, the peer gets no answer. */
    if (n < 0 || send(fd, frame, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT) != n) {
        close_drained(fd);
        return;
    }
    shutdown(fd, SHUT_WR);
    if (l->nlinger == LINGER_MAX) {
        close_drained(fd); /* a flood of refusals: the newest gets a best-effort answer */
        return;
    }
    l->linger_fd[l->nlinger] = fd;
    l->linger_until[l->nlinger] = now_ns() + (int64_t)DRAIN_MS * 1000000;
    l->nlinger++;
}

/* Answers a connection beyond max_conns "listener busy" (refuse_connection). */
static void refuse_busy(wl_listener *l, int fd)
{
    char why[128];
    snprintf(why, sizeof why, "listener busy: all %d connections in use", l->max_conns);
    refuse_connection(l, fd, why);
}

/* Drains the refused connections whose poll entries (in linger order) are ready; closes those whose
   peer closed or whose time is up. */
static void serve_lingering(wl_listener *l, const struct pollfd *pfd)
{
    int64_t now = now_ns();
    int kept = 0;
    for (int i = 0; i < l->nlinger; i++) {
        int fd = l->linger_fd[i];
        int over = (pfd[i].revents & (POLLIN | POLLHUP | POLLERR)) && drain_now(fd, LINGER_BUDGET);
        if (over || now >= l->linger_until[i]) {
            close_drained(fd);
            continue;
        }
        l->linger_fd[kept] = fd;
        l->linger_until[kept] = l->linger_until[i];
        kept++;
    }
    l->nlinger = kept;
}

/* Milliseconds accept_main may sleep: a second (for reaping), or less when a refused connection's
   drain time ends sooner. */
static int accept_wait_ms(const wl_listener *l)
{
    int64_t now = now_ns(), wait = 1000;
    for (int i = 0; i < l->nlinger; i++) {
        int64_t left = (l->linger_until[i] - now + 999999) / 1000000;
        if (left < wait)
            wait = left < 0 ? 0 : left;
    }
    return (int)wait;
}

/* Shuts down the connection furthest behind the rate floor among those that may be taken: any that
   has sent nothing yet (at any age), others once evict_after behind; never one whose bytes are
   waiting, and none at all when evict_after is negative. 1 if one was (its thread then leaves at
   once), 0 if none may be taken. Only the accept thread calls it. */
static int evict_furthest_behind(wl_listener *l)
{
    if (l->evict_after_ns < 0)
        return 0;
    int64_t now = now_ns(), earliest = 0;
    wl_conn *victim = NULL;
    pthread_mutex_lock(&l->lock);
    for (int i = 0; i < l->nslots; i++) {
        wl_conn *c = &l->conns[i];
        if (!c->used || c->fd < 0 || atomic_load(&c->done) || atomic_load(&c->evicted))
            continue;
        int64_t due = atomic_load_explicit(&c->due_ns, memory_order_relaxed);
        /* A connection that has sent nothing holds nothing: it may go at any age. */
        int64_t need = atomic_load(&c->silent) ? 0 : l->evict_after_ns;
        char next;
        if (now - due < need || (victim != NULL && due >= earliest))
            continue;
        if (recv(c->fd, &next, 1, MSG_PEEK | MSG_DONTWAIT) > 0)
            continue; /* its next bytes are here: its thread is about to take them */
        /* Its thread clears `silent` before it takes any byte, so if it is still set now, nothing
           had arrived before the peek above. If it was cleared meanwhile, the first bytes came and
           may already be taken: judge it as a connection that sent some. */
        if (need == 0 && !atomic_load(&c->silent)) {
            due = atomic_load_explicit(&c->due_ns, memory_order_relaxed);
            if (now - due < l->evict_after_ns || (victim != NULL && due >= earliest))
                continue;
        }
        victim = c;
        earliest = due;
    }
    if (victim != NULL) {
        /* Under the lock: the connection's thread closes its fd only while holding it. */
        atomic_store(&victim->evicted, 1);
        /* Reading only: its thread wakes to the end of the stream and can still tell a peer whose
           transfer it was serving why (a send is bounded by SO_SNDTIMEO; nslots leaves room). */
        shutdown(victim->fd, SHUT_RD);
        l->evicted++;
    }
    pthread_mutex_unlock(&l->lock);
    return victim != NULL;
}

/* Starts a thread for a new connection, or refuses it when every slot is busy and none can be freed. */
static void admit(wl_listener *l, int fd)
{
    reap(l);
    wl_conn *slot = NULL;
    int held = 0;
    for (int i = 0; i < l->nslots; i++) {
        if (l->conns[i].used)
            held += !atomic_load(&l->conns[i].evicted);
        else if (slot == NULL)
            slot = &l->conns[i];
    }
    if (slot == NULL || (held >= l->max_conns && !evict_furthest_behind(l))) {
        refuse_busy(l, fd);
        return;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct timeval tv = {.tv_sec = l->recv_timeout_ms / 1000, .tv_usec = (l->recv_timeout_ms % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    slot->owner = l;
    slot->fd = fd;
    atomic_store(&slot->done, 0);
    atomic_store(&slot->evicted, 0);
    atomic_store(&slot->silent, 1);
    atomic_store(&slot->due_ns, now_ns());
    pthread_mutex_lock(&l->lock);
    l->accepted++;
    l->active++;
    pthread_mutex_unlock(&l->lock);
    int err = pthread_create(&slot->thread, NULL, conn_main, slot);
    if (err != 0) {
        /* Turned away, not admitted: counted in `refused` only, and told why. */
        pthread_mutex_lock(&l->lock);
        l->active--;
        l->accepted--;
        slot->fd = -1;
        pthread_mutex_unlock(&l->lock);
        char why[192];
        snprintf(why, sizeof why,
                 "listener cannot serve this connection: starting its thread failed (%s); the receiving process is "
                 "out of threads or memory",
                 strerror(err));
        refuse_connection(l, fd, why);
        return;
    }
    slot->used = 1;
}

/* The accept thread: admits connections and drains refused ones until the wake pipe says stop. */
static void *accept_main(void *arg)
{
    pthread_setname_np(pthread_self(), "epd-wire-accept");
    wl_listener *l = arg;
    struct pollfd pfd[2 + LINGER_MAX];
    for (;;) {
        pfd[0] = (struct pollfd){.fd = l->lfd, .events = POLLIN};
        pfd[1] = (struct pollfd){.fd = l->wake[0], .events = POLLIN};
        for (int i = 0; i < l->nlinger; i++)
            pfd[2 + i] = (struct pollfd){.fd = l->linger_fd[i], .events = POLLIN};
        int r = poll(pfd, (nfds_t)(2 + l->nlinger), accept_wait_ms(l));
        if (atomic_load(&l->stopping))
            break;
        if (r < 0) {
            if (errno != EINTR)
                usleep(10000); /* out of memory for poll's table: back off and try again */
            for (int i = 0; i < l->nlinger; i++)
                pfd[2 + i].revents = 0; /* poll failed: nothing it says is ready */
        } else if (pfd[1].revents != 0) {
            /* A wake without a stop (a forked child's close wrote our pipe): empty it, or every
               poll returns at once. */
            char sink[64];
            ssize_t k = read(l->wake[0], sink, sizeof sink);
            (void)k;
        }
        serve_lingering(l, pfd + 2);
        if (r <= 0 || !(pfd[0].revents & POLLIN)) {
            reap(l);
            continue;
        }
        int fd = accept4(l->lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
                usleep(10000); /* out of descriptors: back off instead of spinning */
            continue;
        }
        admit(l, fd);
    }
    for (int i = 0; i < l->nlinger; i++)
        close_drained(l->linger_fd[i]);
    l->nlinger = 0;
    return NULL;
}

/* Binds and listens on host:port; fills l->lfd and l->port, or returns -1 with a reason and sets
 * *sys_err to the bind's errno (0 when the host did not resolve). */
static int bind_listener(wl_listener *l, const char *host, int port, char *why, size_t whylen, int *sys_err)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE};
    struct addrinfo *res = NULL;
    char service[16];
    l->lfd = -1; /* nothing to close yet, whatever fails below */
    snprintf(service, sizeof service, "%d", port);
    int rc = getaddrinfo(host, service, &hints, &res);
    if (rc != 0) {
        snprintf(why, whylen, "wire listener: cannot resolve %s: %s", host, gai_strerror(rc));
        return -1;
    }
    int err = 0;
    l->lfd = -1;
    for (struct addrinfo *ai = res; ai != NULL && l->lfd < 0; ai = ai->ai_next) {
        int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
            err = errno;
            continue;
        }
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) < 0 || listen(fd, 128) < 0) {
            err = errno;
            close(fd);
            continue;
        }
        l->lfd = fd;
    }
    freeaddrinfo(res);
    if (l->lfd < 0) {
        snprintf(why, whylen, "wire listener: cannot listen on %s:%d: %s", host, port, strerror(err));
        *sys_err = err;
        return -1;
    }
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    getsockname(l->lfd, (struct sockaddr *)&ss, &sl);
    l->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                             : ((struct sockaddr_in *)&ss)->sin_port);
    return 0;
}

/* Stops accepting, wakes and joins every thread, closes every socket (listener_close's work, once).
   In a forked child, which has the descriptors but none of the threads, it only closes the child's
   copies: waking or shutting anything down there would act on the parent's listener. */
static void stop_and_join(wl_listener *l)
{
    if (getpid() != l->pid) {
        /* The lock may have been held by a thread of the parent at the fork, in the middle of closing
           a connection: then the connections' descriptors are left for the child's exit to close. */
        if (pthread_mutex_trylock(&l->lock) == 0) {
            for (int i = 0; i < l->nslots; i++)
                if (l->conns[i].used && l->conns[i].fd >= 0)
                    close(l->conns[i].fd);
            pthread_mutex_unlock(&l->lock);
        }
        for (int i = 0; i < l->nlinger; i++)
            close(l->linger_fd[i]);
        if (l->lfd >= 0)
            close(l->lfd);
        close(l->wake[0]);
        close(l->wake[1]);
        return;
    }
    atomic_store(&l->stopping, 1);
    if (l->started) {
        ssize_t w = write(l->wake[1], "x", 1);
        (void)w;
        pthread_join(l->accept_thread, NULL);
    }
    /* shutdown() wakes a connection blocked in poll or recv; its thread then closes the fd. */
    pthread_mutex_lock(&l->lock);
    for (int i = 0; i < l->nslots; i++)
        if (l->conns[i].used && l->conns[i].fd >= 0)
            shutdown(l->conns[i].fd, SHUT_RDWR);
    pthread_mutex_unlock(&l->lock);
    for (int i = 0; i < l->nslots; i++) {
        if (l->conns[i].used) {
            pthread_join(l->conns[i].thread, NULL);
            l->conns[i].used = 0;
        }
    }
    if (l->lfd >= 0)
        close(l->lfd);
    l->lfd = -1;
    close(l->wake[0]);
    close(l->wake[1]);
}

/* Stops and joins the listener's threads and closes its sockets; idempotent. */
static void listener_close(wl_listener *l)
{
    /* Two Python threads may close at once (the GIL is released here): the first stops and joins,
       the second waits for it, so neither returns while a thread may still copy into memory. */
    pthread_mutex_lock(&l->close_lock);
    if (!atomic_exchange(&l->closed, 1))
        stop_and_join(l);
    pthread_mutex_unlock(&l->close_lock);
}

/* Frees a closed listener. */
static void listener_free(wl_listener *l)
{
    listener_close(l);
    pthread_mutex_destroy(&l->close_lock);
    pthread_rwlock_destroy(&l->regions_lock);
    pthread_mutex_destroy(&l->lock);
    free(l->regions);
    free(l->conns);
    free(l);
}

/* ------------------------------------------------------------------ CPython glue */

#define CAPSULE_NAME "transfer._native.WireListener"

/* The listener behind a capsule, or NULL with TypeError when cap is not one wire_listen made. */
static wl_listener *get_listener(PyObject *cap)
{
    if (!PyCapsule_IsValid(cap, CAPSULE_NAME)) {
        PyErr_Format(PyExc_TypeError, "a wire listener (made by wire_listen) is needed, not %.100s",
                     Py_TYPE(cap)->tp_name);
        return NULL;
    }
    return PyCapsule_GetPointer(cap, CAPSULE_NAME);
}

/* Capsule destructor: stops the threads (without the GIL; they never take it) and frees. */
static void capsule_free(PyObject *cap)
{
    wl_listener *l = PyCapsule_GetPointer(cap, CAPSULE_NAME);
    if (l == NULL) {
        PyErr_Clear();
        return;
    }
    Py_BEGIN_ALLOW_THREADS
    listener_free(l);
    Py_END_ALLOW_THREADS
}

/* Converts seconds to poll milliseconds (at least 1); NaN, which no comparison holds for and which
   int cannot represent, counts as the shortest wait. */
static int to_ms(double s)
{
    if (!(s > 0))
        return 1;
    if (s > 86400.0 * 24)
        return 86400 * 24 * 1000;
    return (int)(s * 1000.0 + 0.5) > 0 ? (int)(s * 1000.0 + 0.5) : 1;
}

PyObject *epd_py_wire_listen(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    static char *keywords[] = {"host",     "port",       "recv_timeout", "idle_timeout",       "chunk_limit",
                               "max_conns", "min_rate", "rate_grace",   "first_byte_timeout", "evict_after",
                               NULL};
    const char *host;
    int port, max_conns;
    double recv_timeout, idle_timeout, min_rate = DEFAULT_MIN_RATE, rate_grace = -1.0, first_byte = -1.0;
    double evict_after = DEFAULT_EVICT_AFTER_MS / 1e3;
    Py_ssize_t chunk_limit;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "siddni|dddd:wire_listen", keywords, &host, &port, &recv_timeout,
                                     &idle_timeout, &chunk_limit, &max_conns, &min_rate, &rate_grace, &first_byte,
                                     &evict_after))
        return NULL;
    if (port < 0 || port > 65535) {
        PyErr_Format(PyExc_ValueError, "wire listener: port %d is outside 0..65535", port);
        return NULL;
    }
    if (isnan(recv_timeout) || isnan(idle_timeout) || isnan(rate_grace) || isnan(first_byte) || isnan(evict_after)) {
        PyErr_SetString(PyExc_ValueError, "wire listener: a timeout is NaN");
        return NULL;
    }
    if (!(min_rate >= 0)) {
        char text[112];
        snprintf(text, sizeof text, "wire listener: min_rate %g is not a rate in bytes/s (0 turns the bound off)",
                 min_rate);
        PyErr_SetString(PyExc_ValueError, text);
        return NULL;
    }
    if (chunk_limit < 1 || (size_t)chunk_limit > EPD_MAX_PAYLOAD - EPD_LAYER_HEADER) {
        PyErr_Format(PyExc_ValueError, "wire listener: chunk_limit %zd is outside 1..%zu", chunk_limit,
                     EPD_MAX_PAYLOAD - EPD_LAYER_HEADER);
        return NULL;
    }
    if (max_conns < 1 || max_conns > 4096) {
        PyErr_Format(PyExc_ValueError, "wire listener: max_conns %d is outside 1..4096", max_conns);
        return NULL;
    }
    wl_listener *l = calloc(1, sizeof *l);
    wl_conn *conns = calloc(2 * (size_t)max_conns, sizeof *conns);
    if (l == NULL || conns == NULL) {
        free(l);
        free(conns);
        return PyErr_NoMemory();
    }
    l->conns = conns;
    l->max_conns = max_conns;
    l->nslots = 2 * max_conns;
    /* A negative evict_after never closes a connection for a new one. */
    l->evict_after_ns = evict_after < 0 ? -1 : (int64_t)to_ms(evict_after) * 1000000;
    l->recv_timeout_ms = to_ms(recv_timeout);
    l->idle_timeout_ms = to_ms(idle_timeout);
    l->min_rate = min_rate;
    /* A negative grace asks for the default, a few receive timeouts. */
    int64_t grace_ms = rate_grace < 0 ? (int64_t)GRACE_TIMEOUTS * l->recv_timeout_ms : to_ms(rate_grace);
    l->grace_ns = grace_ms * 1000000;
    /* A negative first-byte bound asks for the default; either way it never exceeds the idle timeout,
       which a connection that already carried a transfer gets. */
    l->first_byte_ms = first_byte < 0 ? DEFAULT_FIRST_BYTE_MS : to_ms(first_byte);
    if (l->first_byte_ms > l->idle_timeout_ms)
        l->first_byte_ms = l->idle_timeout_ms;
    l->chunk_limit = (size_t)chunk_limit;
    l->wake[0] = l->wake[1] = -1;
    pthread_mutex_init(&l->lock, NULL);
    pthread_mutex_init(&l->close_lock, NULL);
    pthread_rwlockattr_t attr;
    pthread_rwlockattr_init(&attr);
    /* A waiting unregister() must not starve behind a stream of copies. */
    pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    pthread_rwlock_init(&l->regions_lock, &attr);
    pthread_rwlockattr_destroy(&attr);
    char why[REASON_MAX];
    int rc, sys_err = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = bind_listener(l, host, port, why, sizeof why, &sys_err);
    Py_END_ALLOW_THREADS
    if (rc < 0 || pipe2(l->wake, O_CLOEXEC) < 0) {
        if (rc == 0) {
            sys_err = errno;
            snprintf(why, sizeof why, "wire listener: pipe: %s", strerror(sys_err));
        }
        l->closed = 1;
        if (l->lfd >= 0)
            close(l->lfd);
        pthread_mutex_destroy(&l->close_lock);
        pthread_rwlock_destroy(&l->regions_lock);
        pthread_mutex_destroy(&l->lock);
        free(l->conns);
        free(l);
        /* OSError(errno, text): a caller binding the first free port of a range tells "in use" apart. */
        PyObject *exc_args = sys_err ? Py_BuildValue("(is)", sys_err, why) : Py_BuildValue("(s)", why);
        if (exc_args != NULL) {
            PyErr_SetObject(PyExc_OSError, exc_args);
            Py_DECREF(exc_args);
        }
        return NULL;
    }
    /* The accept thread starts with asynchronous signals blocked and its connection threads
       inherit the mask. */
    sigset_t all, old;
    sigfillset(&all);
    int sync_signals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGTRAP, SIGSYS};
    for (size_t i = 0; i < sizeof sync_signals / sizeof sync_signals[0]; i++)
        sigdelset(&all, sync_signals[i]);
    l->pid = getpid();
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int started = pthread_create(&l->accept_thread, NULL, accept_main, l);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (started != 0) {
        listener_free(l);
        PyErr_SetString(PyExc_OSError, "wire listener: cannot start the accept thread");
        return NULL;
    }
    l->started = 1;
    PyObject *cap = PyCapsule_New(l, CAPSULE_NAME, capsule_free);
    if (cap == NULL) {
        Py_BEGIN_ALLOW_THREADS
        listener_free(l);
        Py_END_ALLOW_THREADS
    }
    return cap;
}

PyObject *epd_py_wire_listener_port(PyObject *self, PyObject *cap)
{
    (void)self;
    wl_listener *l = get_listener(cap);
    return l ? PyLong_FromLong(l->port) : NULL;
}

PyObject *epd_py_wire_add_region(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *cap, *addr_o, *len_o;
    uint64_t addr, len;
    if (!PyArg_ParseTuple(args, "OOO:wire_add_region", &cap, &addr_o, &len_o))
        return NULL;
    wl_listener *l = get_listener(cap);
    if (l == NULL)
        return NULL;
    if (epd_u64_arg(addr_o, "wire_add_region: the address", &addr) < 0 ||
        epd_u64_arg(len_o, "wire_add_region: the length", &len) < 0)
        return NULL;
    if (len == 0 || addr == 0 || addr + len < addr) {
        /* snprintf, not PyErr_Format: before Python 3.12 the latter knows no %llx and printed it raw. */
        char text[96];
        snprintf(text, sizeof text, "cannot register region 0x%llx+%llu: empty, null or wrapping",
                 (unsigned long long)addr, (unsigned long long)len);
        PyErr_SetString(PyExc_ValueError, text);
        return NULL;
    }
    /* wire_remove_region answers the length as a signed 64-bit int. */
    if (len > (uint64_t)INT64_MAX) {
        char text[112];
        snprintf(text, sizeof text, "cannot register region 0x%llx+%llu: longer than %lld bytes",
                 (unsigned long long)addr, (unsigned long long)len, (long long)INT64_MAX);
        PyErr_SetString(PyExc_ValueError, text);
        return NULL;
    }
    char why[REASON_MAX];
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = regions_add(l, addr, len, why, sizeof why);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        PyErr_SetString(PyExc_ValueError, why);
        return NULL;
    }
    Py_RETURN_NONE;
}

PyObject *epd_py_wire_remove_region(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *cap, *addr_o;
    uint64_t addr;
    if (!PyArg_ParseTuple(args, "OO:wire_remove_region", &cap, &addr_o))
        return NULL;
    wl_listener *l = get_listener(cap);
    if (l == NULL || epd_u64_arg(addr_o, "wire_remove_region: the address", &addr) < 0)
        return NULL;
    long long len;
    Py_BEGIN_ALLOW_THREADS
    len = regions_remove(l, addr);
    Py_END_ALLOW_THREADS
    if (len < 0) {
        char text[64];
        snprintf(text, sizeof text, "address 0x%llx is not a registered region", (unsigned long long)addr);
        PyErr_SetString(PyExc_KeyError, text);
        return NULL;
    }
    return PyLong_FromLongLong(len);
}

PyObject *epd_py_wire_listener_stats(PyObject *self, PyObject *cap)
{
    (void)self;
    wl_listener *l = get_listener(cap);
    if (l == NULL)
        return NULL;
    unsigned long long accepted, refused, transfers, failures, bytes, too_slow, silent, evicted;
    int active;
    char last[REASON_MAX];
    pthread_mutex_lock(&l->lock);
    too_slow = l->too_slow;
    silent = l->silent;
    evicted = l->evicted;
    accepted = l->accepted;
    refused = l->refused;
    transfers = l->transfers;
    failures = l->failures;
    bytes = l->bytes;
    active = l->active;
    memcpy(last, l->last_error, sizeof last);
    pthread_mutex_unlock(&l->lock);
    pthread_rwlock_rdlock(&l->regions_lock);
    size_t nregions = l->nregions;
    pthread_rwlock_unlock(&l->regions_lock);
    /* A reason quotes what a peer sent, and REASON_MAX may cut it inside a character. */
    PyObject *last_text = PyUnicode_DecodeUTF8(last, (Py_ssize_t)strnlen(last, sizeof last), "replace");
    if (last_text == NULL)
        return NULL;
    return Py_BuildValue("{sKsKsKsKsKsKsKsKsisnsisN}", "accepted", accepted, "refused", refused, "transfers",
                         transfers, "failures", failures, "too_slow", too_slow, "silent", silent, "evicted",
                         evicted, "bytes", bytes,
                         "active", active, "regions", (Py_ssize_t)nregions, "port", l->port, "last_error", last_text);
}

PyObject *epd_py_wire_listener_close(PyObject *self, PyObject *cap)
{
    (void)self;
    wl_listener *l = get_listener(cap);
    if (l == NULL)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    listener_close(l);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}
