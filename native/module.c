/* transfer._native: the CPython face of the native core (argument glue only). */
#include "epd.h"
#include "wire_listener.h"

#include <math.h>

PyObject *epd_FrameError;
PyObject *epd_MsgError;
PyObject *epd_LayerError;

/* Below this size the checksum is cheaper than a GIL round trip. */
#define GIL_RELEASE_BYTES ((Py_ssize_t)1 << 16)

/* Reads an int argument (any integer type: numpy's and torch's too) in 0..max; `what` names it in the
   error: a TypeError when obj is no integer, a ValueError when it is one out of range. ValueError rather
   than the OverflowError of Python's own unsigned conversion: a negative value is out of range, not an
   overflow, and every int argument of the module answers a range error with the one type. */
static int uint_arg(PyObject *obj, const char *what, unsigned long long max, unsigned long long *out)
{
    PyObject *index = PyNumber_Index(obj);
    if (index == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s must be an int in 0..%llu, got %R", what, max, obj);
        }
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(index);
    Py_DECREF(index);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return -1;
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be an int in 0..%llu, got %R", what, max, obj);
        return -1;
    }
    if (v > max) {
        PyErr_Format(PyExc_ValueError, "%s must be an int in 0..%llu, got %R", what, max, obj);
        return -1;
    }
    *out = v;
    return 0;
}

/* Reads an int argument that must fit in u32; `what` names it in the error. */
static int u32_arg(PyObject *obj, const char *what, uint32_t *out)
{
    unsigned long long v;
    if (uint_arg(obj, what, UINT32_MAX, &v) < 0)
        return -1;
    *out = (uint32_t)v;
    return 0;
}

/* Reads an int argument that must fit in u64; `what` names it in the error. Not the "K" format: it
   silently keeps the low 64 bits, so -1 or 2**64 + a would read or register an address nobody asked for. */
int epd_u64_arg(PyObject *obj, const char *what, uint64_t *out)
{
    unsigned long long v;
    if (uint_arg(obj, what, UINT64_MAX, &v) < 0)
        return -1;
    *out = (uint64_t)v;
    return 0;
}

/* Refuses a NaN timeout, as socket.settimeout does; a negative one still means no timeout. */
static int timeout_arg(double timeout, const char *who)
{
    if (isnan(timeout)) {
        PyErr_Format(PyExc_ValueError, "%s: the timeout is NaN", who);
        return -1;
    }
    return 0;
}

/* Checks a least rate (bytes/s, 0: none): finite and not negative, and given only with a timeout (not
   negative: a socket the OS lets the wait end on), since a blocking read or write cannot be stopped. */
static int rate_arg(double min_rate, double timeout, const char *who)
{
    if (!(min_rate >= 0) || isinf(min_rate)) {
        PyErr_Format(PyExc_ValueError, "%s: min_rate must be a finite number of bytes/s (0: none)", who);
        return -1;
    }
    if (min_rate > 0 && timeout < 0) {
        PyErr_Format(PyExc_ValueError, "%s: min_rate needs a timeout: a blocking socket waits on its peer "
                     "however slowly it goes", who);
        return -1;
    }
    return 0;
}

/* Raises the error of obj's failed C-contiguous export, whose exception is set. When obj does export
   strided bytes that are not one C-contiguous run, the BufferError says so; any other failure of the
   export is a BufferError that names the caller and carries the exporter's own error as its cause.
   MemoryError and exceptions that are no Exception (KeyboardInterrupt) go up as they were raised. */
static int export_failed(PyObject *obj, const char *who)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception) || PyErr_ExceptionMatches(PyExc_MemoryError))
        return -1;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    Py_buffer probe;
    if (PyObject_GetBuffer(obj, &probe, PyBUF_FULL_RO) == 0) {
        int contiguous = PyBuffer_IsContiguous(&probe, 'C');
        PyBuffer_Release(&probe);
        if (!contiguous) {
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            PyErr_Format(PyExc_BufferError, "%s needs a C-contiguous buffer; this %.100s is not contiguous", who,
                         Py_TYPE(obj)->tp_name);
            return -1;
        }
    } else {
        PyErr_Clear();
    }
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL)
        PyException_SetTraceback(value, tb);
    Py_XDECREF(tb);
    Py_DECREF(type);
    PyErr_Format(PyExc_BufferError, "%s could not export the buffer of this %.100s: %S", who, Py_TYPE(obj)->tp_name,
                 value);
    PyObject *new_type, *new_value, *new_tb;
    PyErr_Fetch(&new_type, &new_value, &new_tb);
    PyErr_NormalizeException(&new_type, &new_value, &new_tb);
    if (new_value != NULL) {
        PyException_SetContext(new_value, Py_NewRef(value));
        PyException_SetCause(new_value, value); /* steals the reference to value */
    } else {
        Py_DECREF(value);
    }
    PyErr_Restore(new_type, new_value, new_tb);
    return -1;
}

/* Exports obj's bytes as one C-contiguous run, with an error that says what was wrong. */
static int get_contiguous(PyObject *obj, Py_buffer *view, const char *who)
{
    if (!PyObject_CheckBuffer(obj)) {
        PyErr_Format(PyExc_TypeError, "%s needs a buffer (bytes, memoryview, array), not %.100s", who,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0)
        return export_failed(obj, who);
    return 0;
}

/* Sums a region, releasing the GIL when it is long enough to matter. */
static uint64_t sum_region(const void *p, Py_ssize_t len)
{
    uint64_t s;
    if (len >= GIL_RELEASE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        s = epd_layer_sum(p, (size_t)len);
        Py_END_ALLOW_THREADS
    } else {
        s = epd_layer_sum(p, (size_t)len);
    }
    return s;
}

static PyObject *py_layer_sum(PyObject *self, PyObject *obj)
{
    (void)self;
    Py_buffer view;
    if (get_contiguous(obj, &view, "layer_sum") < 0)
        return NULL;
    uint64_t s = sum_region(view.buf, view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(s);
}

static PyObject *py_layer_sum_addr(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *addr_o, *len_o;
    uint64_t addr, len;
    if (!PyArg_ParseTuple(args, "OO:layer_sum_addr", &addr_o, &len_o))
        return NULL;
    if (epd_u64_arg(addr_o, "layer_sum: the address", &addr) < 0 ||
        epd_u64_arg(len_o, "layer_sum: the length", &len) < 0)
        return NULL;
    if (addr == 0 && len > 0) {
        PyErr_SetString(PyExc_ValueError, "layer_sum: a null address with a non-zero length");
        return NULL;
    }
    if (len > (unsigned long long)PY_SSIZE_T_MAX) {
        PyErr_SetString(PyExc_ValueError, "layer_sum: length out of range");
        return NULL;
    }
    if (addr + len < addr) {
        char text[96];
        snprintf(text, sizeof text, "layer_sum: the range 0x%llx+%llu wraps around the address space",
                 (unsigned long long)addr, (unsigned long long)len);
        PyErr_SetString(PyExc_ValueError, text);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(sum_region((const void *)(uintptr_t)addr, (Py_ssize_t)len));
}

static PyObject *py_layer_header(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *layer_o, *rows_o, *checksum_o;
    uint64_t checksum;
    uint32_t layer, rows;
    if (!PyArg_ParseTuple(args, "OOO:layer_header", &layer_o, &rows_o, &checksum_o))
        return NULL;
    if (u32_arg(layer_o, "layer", &layer) < 0 || u32_arg(rows_o, "rows", &rows) < 0 ||
        epd_u64_arg(checksum_o, "checksum", &checksum) < 0)
        return NULL;
    unsigned char h[EPD_LAYER_HEADER];
    epd_put_layer_header(h, layer, rows, checksum);
    return PyBytes_FromStringAndSize((const char *)h, sizeof h);
}

static PyObject *py_layer_frame(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *layer_o, *rows_o, *data_o;
    uint32_t layer, rows;
    if (!PyArg_ParseTuple(args, "OOO:layer_frame", &layer_o, &rows_o, &data_o))
        return NULL;
    if (u32_arg(layer_o, "layer", &layer) < 0 || u32_arg(rows_o, "rows", &rows) < 0)
        return NULL;
    Py_buffer view;
    if (get_contiguous(data_o, &view, "layer_frame") < 0)
        return NULL;
    if ((size_t)view.len > EPD_MAX_PAYLOAD - EPD_LAYER_HEADER) {
        PyErr_Format(PyExc_ValueError, "layer_frame: %zd bytes of rows exceed a frame's %zu", view.len,
                     EPD_MAX_PAYLOAD - EPD_LAYER_HEADER);
        PyBuffer_Release(&view);
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, view.len + EPD_LAYER_HEADER);
    if (out != NULL) {
        unsigned char *w = (unsigned char *)PyBytes_AS_STRING(out);
        uint64_t s;
        Py_BEGIN_ALLOW_THREADS
        s = epd_layer_sum(view.buf, (size_t)view.len);
        memcpy(w + EPD_LAYER_HEADER, view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
        epd_put_layer_header(w, layer, rows, s);
    }
    PyBuffer_Release(&view);
    return out;
}

static PyObject *py_parse_layer(PyObject *self, PyObject *obj)
{
    (void)self;
    Py_buffer view;
    if (get_contiguous(obj, &view, "parse_layer") < 0)
        return NULL;
    PyObject *out = NULL;
    const unsigned char *p = view.buf;
    if (view.len < EPD_LAYER_HEADER) {
        PyErr_Format(epd_LayerError, "LAYER payload shorter than its %d-byte header: %zd bytes",
                     EPD_LAYER_HEADER, view.len);
    } else {
        uint64_t want = epd_get_le64(p + 8);
        uint64_t got = sum_region(p + EPD_LAYER_HEADER, view.len - EPD_LAYER_HEADER);
        if (want != got) {
            char text[96];
            snprintf(text, sizeof text, "LAYER checksum mismatch: header 0x%016llx, computed 0x%016llx",
                     (unsigned long long)want, (unsigned long long)got);
            PyErr_SetString(epd_LayerError, text);
        } else {
            out = Py_BuildValue("(kk)", (unsigned long)epd_get_le32(p), (unsigned long)epd_get_le32(p + 4));
        }
    }
    PyBuffer_Release(&view);
    return out;
}

static PyObject *py_write_frame(PyObject *self, PyObject *args)
{
    (void)self;
    int fd;
    PyObject *kind_o, *parts_o;
    double timeout;
    if (!PyArg_ParseTuple(args, "iOOd:write_frame", &fd, &kind_o, &parts_o, &timeout))
        return NULL;
    if (timeout_arg(timeout, "write_frame") < 0)
        return NULL;
    unsigned long long kind;
    if (uint_arg(kind_o, "frame kind", 255, &kind) < 0)
        return NULL;
    if (!PySequence_Check(parts_o)) {
        PyErr_SetString(PyExc_TypeError, "write_frame needs a sequence of buffers");
        return NULL;
    }
    /* A tuple of its own: a part's buffer export may run Python code that changes a list given. */
    PyObject *seq = PySequence_Tuple(parts_o);
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    Py_buffer *views = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof(Py_buffer));
    if (views == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    Py_ssize_t got = 0;
    int rc = 0;
    for (; got < n; got++) {
        if (get_contiguous(PyTuple_GET_ITEM(seq, got), &views[got], "write_frame") < 0) {
            rc = -1;
            break;
        }
    }
    if (rc == 0)
        rc = epd_write_frame(fd, (unsigned)kind, views, n, timeout);
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    Py_DECREF(seq);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_wire_transfer(PyObject *self, PyObject *args)
{
    (void)self;
    int fd;
    Py_buffer prefill;
    PyObject *layers_o, *rows_o, *chunk_o;
    double timeout, min_rate = 0.0;
    if (!PyArg_ParseTuple(args, "iy*OOOd|d:wire_transfer", &fd, &prefill, &layers_o, &rows_o, &chunk_o, &timeout,
                          &min_rate))
        return NULL;
    PyObject *out = NULL, *seq = NULL;
    struct epd_span spans[16];
    uint32_t rows;
    uint64_t chunk;
    if (timeout_arg(timeout, "wire_transfer") < 0 || u32_arg(rows_o, "rows", &rows) < 0 ||
        epd_u64_arg(chunk_o, "chunk", &chunk) < 0)
        goto done;
    if (rate_arg(min_rate, timeout, "wire_transfer") < 0)
        goto done;
    if (chunk == 0 || chunk > EPD_MAX_PAYLOAD - EPD_LAYER_HEADER) {
        char text[96];
        snprintf(text, sizeof text, "wire_transfer: chunk must be in 1..%zu bytes, got %llu",
                 EPD_MAX_PAYLOAD - EPD_LAYER_HEADER, (unsigned long long)chunk);
        PyErr_SetString(PyExc_ValueError, text);
        goto done;
    }
    /* A tuple of our own: reading an address may run Python (__index__), which could change a list. */
    seq = PySequence_Tuple(layers_o);
    if (seq == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, "wire_transfer needs a sequence of (address, length) pairs");
        }
        goto done;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    if (n < 1 || n > 16) {
        PyErr_Format(PyExc_ValueError, "wire_transfer: 1..16 layers, got %zd", n);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyTuple_GET_ITEM(seq, i);
        uint64_t addr, len;
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "wire_transfer: each layer is an (address, length) tuple");
            goto done;
        }
        if (epd_u64_arg(PyTuple_GET_ITEM(pair, 0), "a layer's address", &addr) < 0 ||
            epd_u64_arg(PyTuple_GET_ITEM(pair, 1), "a layer's length", &len) < 0)
            goto done;
        if (addr == 0 || len == 0 || len > (uint64_t)PY_SSIZE_T_MAX || addr + len < addr) {
            char text[128];
            snprintf(text, sizeof text, "wire_transfer: layer %zd (0x%llx+%llu) is not a non-empty range of "
                     "the address space", i, (unsigned long long)addr, (unsigned long long)len);
            PyErr_SetString(PyExc_ValueError, text);
            goto done;
        }
        spans[i] = (struct epd_span){.addr = addr, .len = (size_t)len};
    }
    out = epd_wire_transfer(fd, &prefill, spans, (int)n, rows, (size_t)chunk, timeout, min_rate);
done:
    Py_XDECREF(seq);
    PyBuffer_Release(&prefill);
    return out;
}

static PyObject *py_read_frame(PyObject *self, PyObject *args)
{
    (void)self;
    int fd;
    double timeout, min_rate = 0.0;
    PyObject *limit_o = NULL;
    uint64_t limit = EPD_MAX_PAYLOAD;
    if (!PyArg_ParseTuple(args, "id|Od:read_frame", &fd, &timeout, &limit_o, &min_rate))
        return NULL;
    if (timeout_arg(timeout, "read_frame") < 0)
        return NULL;
    if (limit_o != NULL && limit_o != Py_None && epd_u64_arg(limit_o, "limit", &limit) < 0)
        return NULL;
    if (limit > EPD_MAX_PAYLOAD) {
        PyErr_Format(PyExc_ValueError, "read_frame: limit must be at most %zu bytes", EPD_MAX_PAYLOAD);
        return NULL;
    }
    if (rate_arg(min_rate, timeout, "read_frame") < 0)
        return NULL;
    return epd_read_frame(fd, timeout, (size_t)limit, min_rate);
}

static PyObject *py_msg_check(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *key, *value;
    if (!PyArg_ParseTuple(args, "OO:msg_check", &key, &value))
        return NULL;
    if (epd_msg_check(key, value) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_msg_encode(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *fields;
    Py_buffer body;
    if (!PyArg_ParseTuple(args, "Oy*:msg_encode", &fields, &body))
        return NULL;
    PyObject *out = epd_msg_encode(fields, &body);
    PyBuffer_Release(&body);
    return out;
}

static PyObject *py_msg_decode(PyObject *self, PyObject *obj)
{
    (void)self;
    Py_buffer data;
    if (get_contiguous(obj, &data, "Msg.decode") < 0)
        return NULL;
    PyObject *out = epd_msg_decode(&data);
    PyBuffer_Release(&data);
    return out;
}

static PyMethodDef methods[] = {
    {"layer_sum", py_layer_sum, METH_O, "layer_sum(buffer) -> int: wrapping u64 sum of LE words."},
    {"layer_sum_addr", py_layer_sum_addr, METH_VARARGS, "layer_sum_addr(address, length) -> int."},
    {"layer_header", py_layer_header, METH_VARARGS, "layer_header(layer, rows, checksum) -> 16 bytes."},
    {"layer_frame", py_layer_frame, METH_VARARGS, "layer_frame(layer, rows, data) -> LAYER payload."},
    {"parse_layer", py_parse_layer, METH_O, "parse_layer(payload) -> (layer, rows); verifies the checksum."},
    {"write_frame", py_write_frame, METH_VARARGS, "write_frame(fd, kind, parts, timeout) -> None."},
    {"read_frame", py_read_frame, METH_VARARGS,
     "read_frame(fd, timeout, limit=64 MiB, min_rate=0) -> (kind, payload, wire_us): min_rate > 0 bounds the "
     "whole read to timeout plus limit bytes at that rate."},
    {"wire_transfer", py_wire_transfer, METH_VARARGS,
     "wire_transfer(fd, prefill, layers, rows, chunk, timeout, min_rate=0) -> (complete, (kind, payload, wire_us)): "
     "PREFILL, each (address, length) layer in checksummed LAYER chunks, FIRST, then the answer; with min_rate "
     "(bytes/s), the peer must take them within timeout plus their bytes at that rate."},
    {"msg_check", py_msg_check, METH_VARARGS, "msg_check(key, value): raises if the field cannot be encoded."},
    {"msg_encode", py_msg_encode, METH_VARARGS, "msg_encode(fields, body) -> bytes."},
    {"msg_decode", py_msg_decode, METH_O, "msg_decode(data) -> (fields, body)."},
    {"zmq_bind", epd_zmq_bind, METH_VARARGS,
     "zmq_bind(msg_init, msg_recv, msg_close, msg_data, msg_size, msg_more, send, errno): libzmq's functions."},
    {"zmq_recv_parts", epd_zmq_recv_parts, METH_VARARGS,
     "zmq_recv_parts(handle, max_bytes=0, max_parts=0) -> list of bytes, None when none queued, or "
     "(bytes, parts) of a message over either bound (0: none), discarded."},
    {"zmq_send_parts", epd_zmq_send_parts, METH_VARARGS, "zmq_send_parts(handle, parts): one message, never blocking."},
    {"lane_match", epd_lane_match, METH_VARARGS,
     "lane_match(parts, lanes, success) -> the room whose lane the status settles, or None."},
    {"lane_take", epd_lane_take, METH_VARARGS,
     "lane_take(handle, lanes, success, most, max_bytes=0, max_parts=0) -> (settled, message, empty): statuses "
     "read in order, the rooms they settle taken out of lanes, up to the first that settles none (message)."},
    {"ask_parse", epd_ask_parse, METH_VARARGS,
     "ask_parse(parts, cls) -> cls(*fields) of a plain TransferInfo's parts, or None when they are not one."},
    {"ask_take", epd_ask_take, METH_VARARGS,
     "ask_take(handle, cls, most, max_bytes=0, max_parts=0) -> (asks, message, empty): plain asks read and "
     "parsed in order, up to the first message that is not one (message)."},
    {"ask_frames", epd_ask_frames, METH_VARARGS,
     "ask_frames(info, cls) -> the parts of a plain TransferInfo (exactly of cls) as to_frames() makes them, or None "
     "when it is not one."},
    {"ask_send", epd_ask_send, METH_VARARGS,
     "ask_send(handle, info, cls) -> True once a plain TransferInfo's parts are queued as one message (OSError as "
     "zmq_send_parts), or None when it is not one (nothing sent)."},
    {"floor_serve", epd_floor_serve, METH_VARARGS,
     "floor_serve(engine, pull, pull_fd, receivers, until, deadline_s, poll_min_s, poll_max_s, base, row_bytes, "
     "starts, step, warmup) -> bytes: the bench floor's encode loop in C, the GIL released."},
    {"floor_receive", epd_floor_receive, METH_VARARGS,
     "floor_receive(push, pull, pull_fd, rank, slots, items, deadline_s, width, nbytes) -> (rooms, slots, "
     "latencies, prints): the bench floor's prefill loop in C, the GIL released."},
    {"mooncake_bind", epd_mooncake_bind, METH_VARARGS,
     "mooncake_bind(path): finds TransferEngine's methods in the loaded library at path (OSError if not)."},
    {"mooncake_open", epd_mooncake_open, METH_VARARGS, "mooncake_open(engine, segment) -> handle, -1 if not opened."},
    {"mooncake_write", (PyCFunction)(void (*)(void))epd_mooncake_write, METH_FASTCALL,
     "mooncake_write(engine, handle, src, dst, length) -> batch id, 0 when refused."},
    {"mooncake_check", (PyCFunction)(void (*)(void))epd_mooncake_check, METH_FASTCALL,
     "mooncake_check(engine, batch) -> 1 done, -1 failed, -2 timed out, 0 in flight, -1000-code unreadable."},
    {"mooncake_settle", (PyCFunction)(void (*)(void))epd_mooncake_settle, METH_FASTCALL,
     "mooncake_settle(engine, batches) -> 1 none left, 0 the first in flight, or a failed batch's code: the "
     "batches (a list) checked in order, those over taken off."},
    {"mooncake_account", epd_mooncake_account, METH_O,
     "mooncake_account(on): counts the thread CPU the write and status calls take from now on, or no longer."},
    {"mooncake_cpu", epd_mooncake_cpu, METH_NOARGS,
     "mooncake_cpu() -> seconds of thread CPU counted inside the write and status calls so far."},
    EPD_WIRE_METHODS
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "transfer._native", "The native core: framed wire, Msg codec, layer checksum.",
    -1, methods, NULL, NULL, NULL, NULL,
};

/* Creates one exception type deriving from `base` and the library's TransferError (so
 * `except TransferError` catches the native errors too), and adds it to the module under
 * its short name. */
static PyObject *add_error(PyObject *m, const char *qualname, const char *name, PyObject *base,
                           PyObject *library_base, const char *doc)
{
    PyObject *bases = PyTuple_Pack(2, base, library_base);
    if (bases == NULL)
        return NULL;
    PyObject *type = PyErr_NewExceptionWithDoc(qualname, doc, bases, NULL);
    Py_DECREF(bases);
    if (type == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, name, type) < 0) {
        Py_DECREF(type);
        return NULL;
    }
    return type;
}

PyMODINIT_FUNC PyInit__native(void)
{
    PyObject *errors = PyImport_ImportModule("transfer.errors");
    if (errors == NULL)
        return NULL;
    PyObject *library_base = PyObject_GetAttrString(errors, "TransferError");
    Py_DECREF(errors);
    if (library_base == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef), *frame_error = NULL, *msg_error = NULL, *layer_error = NULL;
    if (m == NULL ||
        (frame_error = add_error(m, "transfer.wire.FrameError", "FrameError", PyExc_OSError, library_base,
                                 "A framed-wire read or write failed; the message starts with 'read: ' or "
                                 "'write: '.")) == NULL ||
        (msg_error = add_error(m, "transfer.wire.MsgError", "MsgError", PyExc_ValueError, library_base,
                               "A Msg could not be decoded or a field could not be read.")) == NULL ||
        (layer_error = add_error(m, "transfer.wire.LayerError", "LayerError", PyExc_ValueError, library_base,
                                 "A LAYER payload is short or fails its checksum.")) == NULL ||
        PyModule_AddIntConstant(m, "MAX_PAYLOAD", (long)EPD_MAX_PAYLOAD) < 0 ||
        PyModule_AddIntConstant(m, "MAX_ANSWER", (long)EPD_MAX_ANSWER) < 0 ||
        PyModule_AddIntConstant(m, "LAYER_HEADER", EPD_LAYER_HEADER) < 0) {
        /* Everything this init made goes with it; the globals below still hold what an earlier init of
           the same library (a module already loaded) set, which that module's functions raise. */
        Py_XDECREF(frame_error);
        Py_XDECREF(msg_error);
        Py_XDECREF(layer_error);
        Py_XDECREF(m);
        Py_DECREF(library_base);
        return NULL;
    }
    Py_DECREF(library_base);
    Py_XSETREF(epd_FrameError, frame_error);
    Py_XSETREF(epd_MsgError, msg_error);
    Py_XSETREF(epd_LayerError, layer_error);
    return m;
}
