/* Whole multipart ZMQ messages in one call, on sockets pyzmq opened.
 *
 * pyzmq costs about 1 us of Python per part and per RCVMORE query, which for our
 * 13-part TransferInfos is three times what libzmq itself spends. These two calls do
 * the same libzmq calls from C. We do not link libzmq: _io.py hands us the addresses
 * of the functions of the very libzmq pyzmq loaded (zmq_bind), so the sockets and the
 * calls always agree. Both calls are non-blocking (ZMQ_DONTWAIT) and keep the GIL.
 */
#include "epd.h"

#include <errno.h>
#include <string.h>

#define ZMQ_DONTWAIT_ 1
#define ZMQ_SNDMORE_ 2

/* libzmq 4's zmq_msg_t: 64 opaque bytes, pointer-aligned (zmq.h). */
typedef struct {
    unsigned char _[64];
} __attribute__((aligned(sizeof(void *)))) zmq_msg;

static int (*msg_init)(zmq_msg *);
static int (*msg_recv)(zmq_msg *, void *, int);
static int (*msg_close)(zmq_msg *);
static void *(*msg_data)(zmq_msg *);
static size_t (*msg_size)(const zmq_msg *);
static int (*msg_more)(const zmq_msg *);
static int (*sock_send)(void *, const void *, size_t, int);
static int (*zmq_errno_)(void);

/* An OSError carrying libzmq's errno (the caller turns it into zmq.ZMQError). */
static PyObject *zmq_failed(int err)
{
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

static int bound(void)
{
    if (msg_init == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "zmq_bind() was not called");
        return 0;
    }
    return 1;
}

/* Receives a message's next part into msg, which the caller then closes: 0, or -1 with
 * libzmq's errno in *err (never EINTR: an interrupted receive is tried again). */
static int next_part(void *handle, zmq_msg *msg, int *err)
{
    for (;;) {
        msg_init(msg);
        if (msg_recv(msg, handle, ZMQ_DONTWAIT_) >= 0)
            return 0;
        *err = zmq_errno_();
        msg_close(msg);
        if (*err != EINTR)
            return -1;
    }
}

/* Receives and drops what is left of a message whose parts so far were taken (libzmq queues a
 * message's parts together, so they are all there): the next receive starts at the next message. */
static void discard_rest(void *handle)
{
    int more;
    do {
        zmq_msg msg;
        int err;
        if (next_part(handle, &msg, &err) < 0)
            return;
        more = msg_more(&msg);
        msg_close(&msg);
    } while (more);
}

PyObject *epd_zmq_bind(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long f[8];
    if (!PyArg_ParseTuple(args, "KKKKKKKK", &f[0], &f[1], &f[2], &f[3], &f[4], &f[5], &f[6], &f[7]))
        return NULL;
    for (int i = 0; i < 8; i++) {
        if (f[i] == 0) {
            PyErr_SetString(PyExc_ValueError, "a libzmq function address is 0");
            return NULL;
        }
    }
    msg_init = (int (*)(zmq_msg *))(uintptr_t)f[0];
    msg_recv = (int (*)(zmq_msg *, void *, int))(uintptr_t)f[1];
    msg_close = (int (*)(zmq_msg *))(uintptr_t)f[2];
    msg_data = (void *(*)(zmq_msg *))(uintptr_t)f[3];
    msg_size = (size_t(*)(const zmq_msg *))(uintptr_t)f[4];
    msg_more = (int (*)(const zmq_msg *))(uintptr_t)f[5];
    sock_send = (int (*)(void *, const void *, size_t, int))(uintptr_t)f[6];
    zmq_errno_ = (int (*)(void))(uintptr_t)f[7];
    Py_RETURN_NONE;
}

int epd_zmq_ready(void)
{
    return msg_init != NULL;
}

int epd_zmq_recv_into(void *handle, void *buf, size_t cap, int *err)
{
    zmq_msg msg;
    if (next_part(handle, &msg, err) < 0)
        return -1;
    size_t size = msg_size(&msg);
    int more = msg_more(&msg);
    if (size <= cap)
        memcpy(buf, msg_data(&msg), size);
    msg_close(&msg);
    if (more)
        discard_rest(handle);
    if (more || size > cap) {
        *err = EMSGSIZE;
        return -1;
    }
    return (int)size;
}

int epd_zmq_send_bytes(void *handle, const void *buf, size_t n, int *err)
{
    while (sock_send(handle, buf, n, ZMQ_DONTWAIT_) < 0) {
        *err = zmq_errno_();
        if (*err != EINTR)
            return -1;
    }
    return 0;
}

/* zmq_recv_parts(handle, max_bytes=0, max_parts=0) -> list of bytes, None when no message is
 * queued, or, when the message has more than max_bytes in all or more than max_parts parts (0: no
 * bound), the tuple (bytes, parts) it has: its parts are then received and discarded without being
 * copied, so the next call starts at the next message. libzmq's own ZMQ_MAXMSGSIZE bounds each
 * part alone. */
PyObject *epd_zmq_recv_parts(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *handle_obj;
    Py_ssize_t max_bytes = 0, max_parts = 0;
    if (!PyArg_ParseTuple(args, "O|nn", &handle_obj, &max_bytes, &max_parts))
        return NULL;
    void *handle = PyLong_AsVoidPtr(handle_obj);
    if (handle == NULL && PyErr_Occurred())
        return NULL;
    if (!bound())
        return NULL;
    return epd_zmq_recv_message(handle, max_bytes, max_parts);
}

PyObject *epd_zmq_recv_message(void *handle, Py_ssize_t max_bytes, Py_ssize_t max_parts)
{
    PyObject *parts = NULL;
    unsigned long long total = 0, count = 0;
    int over = 0, more = 0;
    for (;;) {
        zmq_msg msg;
        int err;
        if (next_part(handle, &msg, &err) < 0) {
            if (err == EAGAIN && count == 0)
                Py_RETURN_NONE;
            Py_XDECREF(parts); /* a later part always follows its first; anything else is an error */
            return zmq_failed(err);
        }
        size_t size = msg_size(&msg);
        more = msg_more(&msg);
        total += size;
        count++;
        if ((max_bytes > 0 && total > (unsigned long long)max_bytes) ||
            (max_parts > 0 && count > (unsigned long long)max_parts)) {
            over = 1;
            Py_CLEAR(parts);
        }
        if (over) {
            msg_close(&msg);
            if (!more)
                return Py_BuildValue("(KK)", total, count);
            continue;
        }
        PyObject *part = PyBytes_FromStringAndSize(msg_data(&msg), (Py_ssize_t)size);
        msg_close(&msg);
        if (part == NULL)
            goto fail;
        if (parts == NULL && (parts = PyList_New(0)) == NULL) {
            Py_DECREF(part);
            goto fail;
        }
        int appended = PyList_Append(parts, part);
        Py_DECREF(part);
        if (appended < 0)
            goto fail;
        if (!more)
            return parts;
    }
fail: /* out of memory: the error goes up, and the rest of the message with it */
    Py_XDECREF(parts);
    if (more)
        discard_rest(handle);
    return NULL;
}

/* Queues one multipart message of `n` parts (part(ctx, i, &data, &len) gives each): 0, or -1 with an OSError
 * carrying libzmq's errno (EAGAIN when the queue is full, and then nothing was queued). A later part can
 * still fail: libzmq refuses it when the peer's pipe goes away in the middle of the message, rolls back the
 * parts before it and then drops every part up to the message's last. The rest of the message is handed
 * over for that drop to end with it (else the next message would be dropped in its place while reported
 * queued), and the failure is reported: nothing of the message was delivered. */
static int send_message(void *handle, Py_ssize_t n, void (*part)(void *, Py_ssize_t, const char **, size_t *),
                        void *ctx)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *data;
        size_t len;
        part(ctx, i, &data, &len);
        int flags = ZMQ_DONTWAIT_ | (i + 1 < n ? ZMQ_SNDMORE_ : 0);
        while (sock_send(handle, data, len, flags) < 0) {
            int err = zmq_errno_();
            if (err == EINTR)
                continue;
            for (Py_ssize_t j = i + 1; i > 0 && j < n; j++) {
                part(ctx, j, &data, &len);
                int rest_flags = ZMQ_DONTWAIT_ | (j + 1 < n ? ZMQ_SNDMORE_ : 0);
                while (sock_send(handle, data, len, rest_flags) < 0 && zmq_errno_() == EINTR)
                    ;
            }
            zmq_failed(err);
            return -1;
        }
    }
    return 0;
}

static void list_part(void *parts, Py_ssize_t i, const char **data, size_t *len)
{
    PyObject *part = PyList_GET_ITEM((PyObject *)parts, i);
    *data = PyBytes_AS_STRING(part);
    *len = (size_t)PyBytes_GET_SIZE(part);
}

/* zmq_send_parts(handle, parts): queues one multipart message (see send_message); OSError(EAGAIN) when
 * the queue is full, and then nothing was queued. */
PyObject *epd_zmq_send_parts(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *handle_obj, *parts;
    if (!PyArg_ParseTuple(args, "OO!", &handle_obj, &PyList_Type, &parts))
        return NULL;
    void *handle = PyLong_AsVoidPtr(handle_obj);
    if (handle == NULL && PyErr_Occurred())
        return NULL;
    if (!bound())
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(parts);
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "a message has at least one part");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBytes_Check(PyList_GET_ITEM(parts, i))) {
            PyErr_Format(PyExc_TypeError, "part %zd is %.80s, not bytes", i, Py_TYPE(PyList_GET_ITEM(parts, i))->tp_name);
            return NULL;
        }
    }
    if (send_message(handle, n, list_part, parts) < 0)
        return NULL;
    Py_RETURN_NONE;
}

struct spans {
    const char *const *data;
    const size_t *len;
};

static void span_part(void *ctx, Py_ssize_t i, const char **data, size_t *len)
{
    const struct spans *spans = ctx;
    *data = spans->data[i];
    *len = spans->len[i];
}

int epd_zmq_send_spans(void *handle, const char *const *data, const size_t *len, Py_ssize_t n)
{
    if (!bound())
        return -1;
    struct spans spans = {data, len};
    return send_message(handle, n, span_part, &spans);
}

PyObject *epd_zmq_take(PyObject *handle_obj, Py_ssize_t most, Py_ssize_t max_bytes, Py_ssize_t max_parts,
                       epd_taker take, void *ctx)
{
    void *handle = PyLong_AsVoidPtr(handle_obj);
    if (handle == NULL && PyErr_Occurred())
        return NULL;
    if (!bound())
        return NULL;
    PyObject *taken = PyList_New(0);
    if (taken == NULL)
        return NULL;
    PyObject *message = NULL;
    int empty = 0;
    for (Py_ssize_t i = 0; i < most; i++) {
        message = epd_zmq_recv_message(handle, max_bytes, max_parts);
        if (message == NULL)
            break;
        if (message == Py_None) {
            empty = 1;
            break;
        }
        int took = take(ctx, message, taken);
        if (took < 0) {
            PyErr_Clear(); /* out of memory taking it: the general path takes the message */
            took = 0;
        }
        if (took == 0)
            break;
        Py_CLEAR(message);
    }
    if (PyErr_Occurred()) { /* the receive failed */
        if (PyList_GET_SIZE(taken) == 0) {
            Py_DECREF(taken);
            return NULL;
        }
        PyErr_Clear(); /* what was taken is handed over; the failure is told in epd.h */
    }
    if (message == NULL || message == Py_None) {
        Py_XDECREF(message);
        message = Py_NewRef(Py_None);
    }
    return Py_BuildValue("(NNO)", taken, message, empty ? Py_True : Py_False);
}
