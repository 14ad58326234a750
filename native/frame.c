/* The framed wire: u32 LE length, u8 kind, payload; whole reads and writes on a file descriptor. */
#include "epd.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

/* Outcomes of io_all; anything but IO_OK leaves *done at the bytes moved so far. */
enum { IO_OK, IO_EOF, IO_ERRNO, IO_TIMEOUT, IO_SIGNAL };

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

/* Waits until fd is ready: a socket with a Python timeout is non-blocking at the OS level. */
static int wait_ready(int fd, int writing, double timeout, PyThreadState **ts)
{
    for (;;) {
        struct pollfd pfd = {.fd = fd, .events = writing ? POLLOUT : POLLIN};
        int ms = poll_ms(timeout);
        int r = poll(&pfd, 1, ms);
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

/* Moves every byte of the iovec list (readv or writev), GIL released; called with the GIL held.
   The timeout bounds each wait for progress, not the whole transfer, so big frames on a
   slow link still complete while a silent peer is caught. */
static int io_all(int fd, struct iovec *iov, int cnt, int writing, double timeout, size_t *done, int *err)
{
    int rc = IO_OK;
    *done = 0;
    *err = 0;
    PyThreadState *ts = PyEval_SaveThread();
    while (cnt > 0) {
        if (iov->iov_len == 0) {
            iov++;
            cnt--;
            continue;
        }
        int batch = cnt > IOV_MAX ? IOV_MAX : cnt;
        ssize_t n = writing ? writev(fd, iov, batch) : readv(fd, iov, batch);
        if (n > 0) {
            *done += (size_t)n;
            iov_advance(&iov, &cnt, (size_t)n);
            continue;
        }
        if (n == 0) {
            rc = IO_EOF;
            break;
        }
        if (errno == EINTR) {
            if (check_signals(&ts) < 0) {
                rc = IO_SIGNAL;
                break;
            }
            continue;
        }
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            rc = wait_ready(fd, writing, timeout, &ts);
            if (rc == IO_OK)
                continue;
            if (rc == IO_ERRNO)
                *err = errno;
            break;
        }
        *err = errno;
        rc = IO_ERRNO;
        break;
    }
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
    size_t total = 0;
    for (Py_ssize_t i = 0; i < nparts; i++)
        total += (size_t)parts[i].len;
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
    unsigned char header[5];
    epd_put_le32(header, (uint32_t)(total + 1));
    header[4] = (unsigned char)kind;
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

PyObject *epd_read_frame(int fd, double timeout)
{
    unsigned char lenbuf[4];
    struct iovec iov[2] = {{.iov_base = lenbuf, .iov_len = sizeof lenbuf}};
    size_t done;
    int err;
    int rc = io_all(fd, iov, 1, 0, timeout, &done, &err);
    if (rc == IO_EOF) {
        if (done == 0)
            raise_frame_error(0, "read: connection closed before a frame header");
        else
            raise_frame_error(0, "read: connection closed inside a frame header after %zu of 4 bytes",
                              done);
        return NULL;
    }
    if (rc != IO_OK) {
        raise_io("read", rc, err, timeout);
        return NULL;
    }
    long long t0 = now_us();
    uint32_t length = epd_get_le32(lenbuf);
    if (length == 0) {
        raise_frame_error(0, "read: zero-length frame has no kind byte");
        return NULL;
    }
    /* Checked before anything is allocated: a hostile length must not cost memory. */
    size_t payload_len = (size_t)length - 1;
    if (payload_len > EPD_MAX_PAYLOAD) {
        raise_frame_error(0, "read: frame payload of %zu bytes exceeds the limit of %zu bytes",
                          payload_len, EPD_MAX_PAYLOAD);
        return NULL;
    }
    PyObject *payload = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)payload_len);
    if (payload == NULL)
        return NULL;
    unsigned char kind = 0;
    iov[0].iov_base = &kind;
    iov[0].iov_len = 1;
    iov[1].iov_base = PyBytes_AS_STRING(payload);
    iov[1].iov_len = payload_len;
    rc = io_all(fd, iov, 2, 0, timeout, &done, &err);
    long long t1 = now_us();
    if (rc != IO_OK) {
        Py_DECREF(payload);
        if (rc == IO_EOF)
            raise_frame_error(0, "read: connection closed mid-payload after %zu of %u bytes", done,
                              (unsigned)length);
        else
            raise_io("read", rc, err, timeout);
        return NULL;
    }
    return Py_BuildValue("(iNL)", (int)kind, payload, t1 - t0);
}
