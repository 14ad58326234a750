/* The framed wire: u32 LE length, u8 kind, payload; whole reads and writes on a file descriptor. */
#include "epd.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

/* Outcomes of io_all; anything but IO_OK leaves *done at the bytes moved so far. */
enum { IO_OK, IO_EOF, IO_ERRNO, IO_TIMEOUT, IO_SIGNAL, IO_SLOW };

/* Microseconds on the monotonic clock. */
static long long now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000LL + ts.tv_nsec / 1000;
}

/* Drops n transferred bytes from the front of the iovec list. */
static void iov_advance(struct iovec **iov, int *cnt, size_t n)
{
    while (*cnt > 0 && n >= (*iov)->iov_len) {
        n -= (*iov)->iov_len;
        (*iov)++;
        (*cnt)--;
    }
    if (*cnt > 0 && n > 0) {
        (*iov)->iov_base = (char *)(*iov)->iov_base + n;
        (*iov)->iov_len -= n;
    }
}

/* Runs the pending signal handlers with the GIL; -1 when one raised (PEP 475 behaviour). */
static int check_signals(PyThreadState **ts)
{
    PyEval_RestoreThread(*ts);
    int rc = PyErr_CheckSignals();
    *ts = PyEval_SaveThread();
    return rc;
}

/* A timeout in seconds as poll() milliseconds: -1 (wait forever) when negative or NaN, capped at
   INT_MAX, since converting a double that int cannot hold is undefined behaviour. */
static int poll_ms(double timeout)
{
    if (!(timeout >= 0))
        return -1;
    double ms = ceil(timeout * 1000.0);
    return ms >= (double)INT_MAX ? INT_MAX : (int)ms;
}

/* Waits until fd is ready: a socket with a Python timeout is non-blocking at the OS level. A signal
   cuts the wait short; the wait then goes on for what is left of the timeout, not all of it again. */
static int wait_ready(int fd, int writing, double timeout, PyThreadState **ts)
{
    int bounded = timeout >= 0 && timeout < 1e9; /* beyond that, poll_ms's cap bounds each wait */
    long long end_us = bounded ? now_us() + (long long)ceil(timeout * 1e6) : 0;
    for (;;) {
        struct pollfd pfd = {.fd = fd, .events = writing ? POLLOUT : POLLIN};
        double wait = timeout;
        if (bounded) {
            long long left = end_us - now_us();
            wait = left > 0 ? (double)left / 1e6 : 0.0;
        }
        int r = poll(&pfd, 1, poll_ms(wait));
        if (r > 0)
            return IO_OK;
        if (r == 0)
            return IO_TIMEOUT;
        if (errno != EINTR)
            return IO_ERRNO;
        if (check_signals(ts) < 0)
            return IO_SIGNAL;
    }
}

/* One gather write. On a socket it is sendmsg with MSG_NOSIGNAL, so a peer that hung up is
   an EPIPE error, never a SIGPIPE that kills a host process which did not ignore it (Python
   does; an engine embedding it may not); other descriptors (pipes) take writev. */
static ssize_t gather_write(int fd, struct iovec *iov, int cnt, int *not_socket)
{
    if (!*not_socket) {
        struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)cnt};
        ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (n >= 0 || errno != ENOTSOCK)
            return n;
        *not_socket = 1;
    }
    return writev(fd, iov, cnt);
}

/* Moves every byte of the iovec list (readv or writev); called with the GIL released, *ts being
   the saved thread state (signal handlers run with it). The timeout bounds each wait for
   progress, not the whole transfer, so big frames on a slow link still complete while a silent
   peer is caught; a deadline (monotonic us, 0: none) bounds the whole call, IO_SLOW past it. */
static int io_loop(int fd, struct iovec *iov, int cnt, int writing, double timeout, long long deadline_us,
                   size_t *done, int *err, PyThreadState **ts)
{
    *done = 0;
    *err = 0;
    int not_socket = 0;
    while (cnt > 0) {
        if (iov->iov_len == 0) {
            iov++;
            cnt--;
            continue;
        }
        int batch = cnt > IOV_MAX ? IOV_MAX : cnt;
        ssize_t n = writing ? gather_write(fd, iov, batch, &not_socket) : readv(fd, iov, batch);
        if (n > 0) {
            *done += (size_t)n;
            iov_advance(&iov, &cnt, (size_t)n);
            /* A blocking write returns short only when a signal cut it after some bytes moved (not
               EINTR): its handler runs before the next call blocks. Short writes to a non-blocking
               socket are its buffer filling, and short reads are normal: neither takes the GIL here
               (the waits below see a signal as EINTR). */
            if (cnt > 0 && writing && timeout < 0 && check_signals(ts) < 0)
                return IO_SIGNAL;
            continue;
        }
        if (n == 0)
            return IO_EOF;
        if (errno == EINTR) {
            if (check_signals(ts) < 0)
                return IO_SIGNAL;
            continue;
        }
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            double wait = timeout;
            int bounded = 0;
            if (deadline_us > 0) {
                long long left = deadline_us - now_us();
                if (left <= 0)
                    return IO_SLOW;
                if (wait < 0 || (double)left / 1e6 < wait) {
                    wait = (double)left / 1e6;
                    bounded = 1;
                }
            }
            int rc = wait_ready(fd, writing, wait, ts);
            if (rc == IO_OK)
                continue;
            if (rc == IO_TIMEOUT && bounded)
                return IO_SLOW;
            if (rc == IO_ERRNO)
                *err = errno;
            return rc;
        }
        *err = errno;
        return IO_ERRNO;
    }
    return IO_OK;
}

/* io_loop with the GIL released around it; called with the GIL held. */
static int io_all(int fd, struct iovec *iov, int cnt, int writing, double timeout, size_t *done, int *err)
{
    PyThreadState *ts = PyEval_SaveThread();
    int rc = io_loop(fd, iov, cnt, writing, timeout, 0, done, err, &ts);
    PyEval_RestoreThread(ts);
    return rc;
}

/* Raises FrameError(message) carrying errno (0 when the failure is not an OS error). */
static void raise_frame_error(int err, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    PyObject *msg = PyUnicode_FromFormatV(fmt, ap);
    va_end(ap);
    if (msg == NULL)
        return;
    PyObject *exc = PyObject_CallOneArg(epd_FrameError, msg);
    Py_DECREF(msg);
    if (exc == NULL)
        return;
    if (err != 0) {
        PyObject *code = PyLong_FromLong(err);
        if (code != NULL) {
            PyObject_SetAttrString(exc, "errno", code);
            Py_DECREF(code);
        }
    }
    PyErr_SetObject(epd_FrameError, exc);
    Py_DECREF(exc);
}

/* Turns a failed io_all outcome into FrameError; `what` is "read" or "write". */
static void raise_io(const char *what, int rc, int err, double timeout)
{
    if (rc == IO_SIGNAL)
        return; /* the signal handler's exception is already set */
    if (rc == IO_TIMEOUT) {
        char secs[32];
        snprintf(secs, sizeof secs, "%g", timeout);
        raise_frame_error(ETIMEDOUT, "%s: timed out after %s s without progress", what, secs);
        return;
    }
    raise_frame_error(err, "%s: %s", what, strerror(err));
}

int epd_write_frame(int fd, unsigned kind, Py_buffer *parts, Py_ssize_t nparts, double timeout)
{
    /* The sum stops short of wrapping: lengths adding up past SIZE_MAX must not pass the limit. */
    size_t total = 0;
    int past_size_max = 0;
    for (Py_ssize_t i = 0; i < nparts; i++) {
        if ((size_t)parts[i].len > SIZE_MAX - total)
            past_size_max = 1;
        else
            total += (size_t)parts[i].len;
    }
    if (past_size_max) {
        raise_frame_error(0, "write: payload of more than %zu bytes exceeds the limit of %zu bytes", (size_t)SIZE_MAX,
                          EPD_MAX_PAYLOAD);
        return -1;
    }
    if (total > EPD_MAX_PAYLOAD) {
        raise_frame_error(0, "write: payload of %zu bytes exceeds the limit of %zu bytes", total,
                          EPD_MAX_PAYLOAD);
        return -1;
    }
    if (nparts > INT_MAX - 1) {
        raise_frame_error(0, "write: too many payload parts (%zd)", nparts);
        return -1;
    }
    /* One gather write carries the header and every part: a small frame is one syscall. */
    unsigned char header[EPD_FRAME_HEADER];
    epd_put_frame_header(header, total, kind);
    struct iovec *iov = PyMem_Malloc(sizeof(struct iovec) * (size_t)(nparts + 1));
    if (iov == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    iov[0].iov_base = header;
    iov[0].iov_len = sizeof header;
    for (Py_ssize_t i = 0; i < nparts; i++) {
        iov[i + 1].iov_base = parts[i].buf;
        iov[i + 1].iov_len = (size_t)parts[i].len;
    }
    size_t done;
    int err;
    int rc = io_all(fd, iov, (int)nparts + 1, 1, timeout, &done, &err);
    PyMem_Free(iov);
    if (rc == IO_OK)
        return 0;
    if (rc == IO_EOF)
        raise_frame_error(0, "write: the connection accepted no bytes after %zu of %zu", done,
                          total + sizeof header);
    else
        raise_io("write", rc, err, timeout);
    return -1;
}

/* Payloads up to this size are read with the header in one GIL release, into a stack buffer. */
#define SMALL_PAYLOAD 4096

/* What bounds the read of one frame: each wait for progress (timeout, seconds, < 0: none), the
   whole read (deadline_us, monotonic, 0: none) and the payload's length. */
struct read_bounds {
    double timeout;
    long long deadline_us;
    size_t limit;
    double within;  /* the whole read's seconds, for the error's text */
};

/* Raises the FrameError of a failed read (a timeout, past the whole read's deadline, an OS error). */
static void raise_read(int rc, int err, const struct read_bounds *bounds)
{
    if (rc == IO_SLOW) {
        char secs[32];
        snprintf(secs, sizeof secs, "%g", bounds->within);
        raise_frame_error(ETIMEDOUT, "read: the frame did not come whole within %s s; read stopped", secs);
        return;
    }
    raise_io("read", rc, err, bounds->timeout);
}

/* Raises the FrameError for a failed read of a frame's kind and payload. */
static void raise_payload_io(int rc, int err, size_t done, uint32_t length, const struct read_bounds *bounds)
{
    if (rc == IO_EOF)
        raise_frame_error(0, "read: connection closed mid-payload after %zu of %u bytes", done, (unsigned)length);
    else
        raise_read(rc, err, bounds);
}

/* Reads the 4-byte length (GIL released, *ts saved); 0, or -1 with FrameError raised after
   restoring the thread state into *ts (the caller must not restore it again). */
static int read_length(int fd, const struct read_bounds *bounds, PyThreadState **ts, uint32_t *length)
{
    unsigned char lenbuf[4];
    struct iovec iov = {.iov_base = lenbuf, .iov_len = sizeof lenbuf};
    size_t done;
    int err;
    int rc = io_loop(fd, &iov, 1, 0, bounds->timeout, bounds->deadline_us, &done, &err, ts);
    if (rc == IO_OK) {
        *length = epd_get_le32(lenbuf);
        if (*length == 0)
            rc = -2;
        else if ((size_t)*length - 1 > bounds->limit)
            rc = -3;
        else
            return 0;
    }
    PyEval_RestoreThread(*ts);
    *ts = NULL;
    if (rc == IO_EOF && done == 0)
        raise_frame_error(0, "read: connection closed before a frame header");
    else if (rc == IO_EOF)
        raise_frame_error(0, "read: connection closed inside a frame header after %zu of 4 bytes", done);
    else if (rc == -2)
        raise_frame_error(0, "read: zero-length frame has no kind byte");
    else if (rc == -3)
        /* Checked before anything is allocated: a hostile length must not cost memory. */
        raise_frame_error(0, "read: frame payload of %zu bytes exceeds the limit of %zu bytes",
                          (size_t)*length - 1, bounds->limit);
    else
        raise_read(rc, err, bounds);
    return -1;
}

/* Reads one frame; called with the GIL released (*ts saved) and returns with it held. A small
   payload (an answer, a control frame) comes in the same release as its header. */
static PyObject *read_frame_released(int fd, const struct read_bounds *bounds, PyThreadState *ts)
{
    uint32_t length;
    if (read_length(fd, bounds, &ts, &length) < 0)
        return NULL;
    long long t0 = now_us();
    size_t payload_len = (size_t)length - 1;
    unsigned char kind = 0;
    size_t done;
    int err;
    if (payload_len <= SMALL_PAYLOAD) {
        unsigned char small[SMALL_PAYLOAD];
        struct iovec iov[2] = {{.iov_base = &kind, .iov_len = 1}, {.iov_base = small, .iov_len = payload_len}};
        int rc = io_loop(fd, iov, 2, 0, bounds->timeout, bounds->deadline_us, &done, &err, &ts);
        long long t1 = now_us();
        PyEval_RestoreThread(ts);
        if (rc != IO_OK) {
            raise_payload_io(rc, err, done, length, bounds);
            return NULL;
        }
        return Py_BuildValue("(iy#L)", (int)kind, (const char *)small, (Py_ssize_t)payload_len, t1 - t0);
    }
    PyEval_RestoreThread(ts);
    PyObject *payload = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)payload_len);
    if (payload == NULL)
        return NULL;
    struct iovec iov[2] = {{.iov_base = &kind, .iov_len = 1},
                           {.iov_base = PyBytes_AS_STRING(payload), .iov_len = payload_len}};
    ts = PyEval_SaveThread();
    int rc = io_loop(fd, iov, 2, 0, bounds->timeout, bounds->deadline_us, &done, &err, &ts);
    PyEval_RestoreThread(ts);
    long long t1 = now_us();
    if (rc != IO_OK) {
        Py_DECREF(payload);
        raise_payload_io(rc, err, done, length, bounds);
        return NULL;
    }
    return Py_BuildValue("(iNL)", (int)kind, payload, t1 - t0);
}

/* The bounds of a read of at most `limit` bytes: with a least rate (and a timeout), the whole read
   gets one timeout plus `limit` bytes at that rate from now, so a peer dribbling it cannot hold the
   reading thread however it paces its bytes. */
static struct read_bounds bounds_at_rate(double timeout, size_t limit, double min_rate)
{
    struct read_bounds bounds = {.timeout = timeout, .deadline_us = 0, .limit = limit, .within = 0};
    if (min_rate > 0 && timeout > 0) {
        bounds.within = timeout + (double)limit / min_rate;
        if (bounds.within < 1e9)
            bounds.deadline_us = now_us() + (long long)(bounds.within * 1e6);
    }
    return bounds;
}

PyObject *epd_read_frame(int fd, double timeout, size_t limit, double min_rate)
{
    struct read_bounds bounds = bounds_at_rate(timeout, limit, min_rate);
    return read_frame_released(fd, &bounds, PyEval_SaveThread());
}

/* Sets `stage` on the FrameError being raised, telling the caller how far a transfer got. */
static void tag_stage(const char *stage)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL) {
        PyObject *text = PyUnicode_FromString(stage);
        if (text == NULL || PyObject_SetAttrString(value, "stage", text) < 0)
            PyErr_Clear();
        Py_XDECREF(text);
    }
    PyErr_Restore(type, value, tb);
}

/* Raises the FrameError of a transfer stopped for falling behind its least rate. */
static void raise_slow(size_t sent, size_t total, long long elapsed_us, double min_rate)
{
    char secs[32], rate[32];
    snprintf(secs, sizeof secs, "%.1f", (double)elapsed_us / 1e6);
    snprintf(rate, sizeof rate, "%.0f", min_rate);
    raise_frame_error(ETIMEDOUT, "write: the peer took %zu of %zu bytes in %s s, behind the least rate of %s "
                      "bytes/s; transfer stopped", sent, total, secs, rate);
}

/* Whether the peer has something for us (an early answer, or a hang-up) right now. */
static int peer_spoke(int fd)
{
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    return poll(&pfd, 1, 0) > 0;
}

PyObject *epd_wire_transfer(int fd, Py_buffer *prefill, const struct epd_span *layers, int nlayers, uint32_t rows,
                            size_t chunk, double timeout, double min_rate)
{
    if ((size_t)prefill->len > EPD_MAX_PAYLOAD) {
        raise_frame_error(0, "write: payload of %zd bytes exceeds the limit of %zu bytes", prefill->len,
                          EPD_MAX_PAYLOAD);
        return NULL;
    }
    unsigned char prefill_header[EPD_FRAME_HEADER], first_frame[EPD_FRAME_HEADER];
    unsigned char chunk_header[EPD_FRAME_HEADER + EPD_LAYER_HEADER];
    epd_put_frame_header(prefill_header, (size_t)prefill->len, EPD_KIND_PREFILL);
    epd_put_frame_header(first_frame, 0, EPD_KIND_FIRST);
    size_t prefill_bytes = sizeof prefill_header + (size_t)prefill->len;
    /* With a least rate, the whole write phase gets one timeout plus its bytes at that rate: a peer
       that reads a byte just inside every timeout cannot hold this thread for ever. */
    size_t total = prefill_bytes;
    for (int layer = 0; layer < nlayers; layer++)
        total += layers[layer].len;
    long long started_us = now_us(), deadline_us = 0;
    if (min_rate > 0) {
        double budget_us = ((timeout > 0 ? timeout : 0) + (double)total / min_rate) * 1e6;
        deadline_us = budget_us < 1e15 ? started_us + (long long)budget_us : 0;
    }

    PyThreadState *ts = PyEval_SaveThread();
    struct iovec iov[5];
    int cnt = 0;
    iov[cnt++] = (struct iovec){.iov_base = prefill_header, .iov_len = sizeof prefill_header};
    iov[cnt++] = (struct iovec){.iov_base = prefill->buf, .iov_len = (size_t)prefill->len};
    int complete = 1, rc = IO_OK, err = 0, untouched = 1;
    size_t done = 0, sent = 0;
    for (int layer = 0; layer < nlayers && complete && rc == IO_OK; layer++) {
        const unsigned char *src = (const unsigned char *)(uintptr_t)layers[layer].addr;
        size_t n = layers[layer].len;
        for (size_t off = 0; off < n; off += chunk) {
            size_t size = n - off < chunk ? n - off : chunk;
            /* Zero copy: the frame is gathered straight from the source memory. */
            epd_put_frame_header(chunk_header, EPD_LAYER_HEADER + size, EPD_KIND_LAYER);
            epd_put_layer_header(chunk_header + EPD_FRAME_HEADER, (uint32_t)layer, rows,
                                 epd_layer_sum(src + off, size));
            iov[cnt++] = (struct iovec){.iov_base = chunk_header, .iov_len = sizeof chunk_header};
            iov[cnt++] = (struct iovec){.iov_base = (void *)(src + off), .iov_len = size};
            int last = layer == nlayers - 1 && off + size == n;
            if (last)  /* FIRST rides with the last chunk: a small transfer is one system call */
                iov[cnt++] = (struct iovec){.iov_base = first_frame, .iov_len = sizeof first_frame};
            rc = io_loop(fd, iov, cnt, 1, timeout, deadline_us, &done, &err, &ts);
            sent += done;
            if (untouched && (rc == IO_OK || done >= prefill_bytes))
                untouched = 0;
            cnt = 0;
            if (rc != IO_OK)
                break;
            if (!last && peer_spoke(fd)) {  /* it refused us mid-transfer: read why, send no more */
                complete = 0;
                break;
            }
        }
    }
    if (rc != IO_OK) {
        PyEval_RestoreThread(ts);
        if (rc == IO_EOF)
            raise_frame_error(0, "write: the connection accepted no bytes after %zu", done);
        else if (rc == IO_SLOW)
            raise_slow(sent, total, now_us() - started_us, min_rate);
        else
            raise_io("write", rc, err, timeout);
        tag_stage(untouched ? "prefill" : "data");
        return NULL;
    }
    struct read_bounds bounds = bounds_at_rate(timeout, EPD_MAX_ANSWER, min_rate);
    PyObject *answer = read_frame_released(fd, &bounds, ts);
    if (answer == NULL) {
        tag_stage("answer");
        return NULL;
    }
    PyObject *out = Py_BuildValue("(OO)", complete ? Py_True : Py_False, answer);
    Py_DECREF(answer);
    return out;
}
