/* The Msg codec: sorted `key=value` lines (UTF-8), a blank line, then the raw body bytes. */
#include "epd.h"

#include <string.h>

/* Validates one field: key and value are str, the key holds no '=' or '\n', the value no '\n'. */
int epd_msg_check(PyObject *key, PyObject *value)
{
    if (!PyUnicode_Check(key)) {
        PyErr_Format(PyExc_TypeError, "a Msg key must be str, not %.100s", Py_TYPE(key)->tp_name);
        return -1;
    }
    if (!PyUnicode_Check(value)) {
        PyErr_Format(PyExc_TypeError, "Msg value of %R must be str, not %.100s", key,
                     Py_TYPE(value)->tp_name);
        return -1;
    }
    Py_ssize_t klen, vlen;
    const char *k = PyUnicode_AsUTF8AndSize(key, &klen);
    if (k == NULL)
        return -1;
    const char *v = PyUnicode_AsUTF8AndSize(value, &vlen);
    if (v == NULL)
        return -1;
    if (memchr(k, '=', (size_t)klen) != NULL || memchr(k, '\n', (size_t)klen) != NULL) {
        PyErr_Format(PyExc_ValueError, "a Msg key must not contain '=' or a newline: %R", key);
        return -1;
    }
    if (memchr(v, '\n', (size_t)vlen) != NULL) {
        PyErr_Format(PyExc_ValueError, "Msg value of %R must not contain a newline", key);
        return -1;
    }
    return 0;
}

/* The (key, value) pair of item i of a sorted items list (borrowed references). */
static void item_at(PyObject *items, Py_ssize_t i, PyObject **key, PyObject **value)
{
    PyObject *item = PyList_GET_ITEM(items, i);
    *key = PyTuple_GET_ITEM(item, 0);
    *value = PyTuple_GET_ITEM(item, 1);
}

PyObject *epd_msg_encode(PyObject *fields, Py_buffer *body)
{
    if (!PyDict_Check(fields)) {
        PyErr_SetString(PyExc_TypeError, "msg_encode needs a dict of str to str");
        return NULL;
    }
    /* A snapshot of the pairs, never a lookup: hashing or comparing a str subclass key runs Python
       code that may change the dict, and the bytes counted below must be exactly the bytes written.
       Distinct keys decide every comparison, so the pairs sort in key order: str order is code point
       order, which is also the UTF-8 byte order of the keys. */
    PyObject *items = PyDict_Items(fields);
    if (items == NULL || PyList_Sort(items) < 0) {
        Py_XDECREF(items);
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(items);
    size_t total = 1 + (size_t)body->len;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key, *value;
        item_at(items, i, &key, &value);
        if (epd_msg_check(key, value) < 0) {
            Py_DECREF(items);
            return NULL;
        }
        Py_ssize_t klen, vlen;
        PyUnicode_AsUTF8AndSize(key, &klen);
        PyUnicode_AsUTF8AndSize(value, &vlen);
        total += (size_t)klen + (size_t)vlen + 2;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
    if (out == NULL) {
        Py_DECREF(items);
        return NULL;
    }
    char *w = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key, *value;
        item_at(items, i, &key, &value);
        Py_ssize_t klen, vlen;
        const char *k = PyUnicode_AsUTF8AndSize(key, &klen);
        const char *v = PyUnicode_AsUTF8AndSize(value, &vlen);
        memcpy(w, k, (size_t)klen);
        w += klen;
        *w++ = '=';
        memcpy(w, v, (size_t)vlen);
        w += vlen;
        *w++ = '\n';
    }
    *w++ = '\n';
    if (body->len > 0)
        memcpy(w, body->buf, (size_t)body->len);
    Py_DECREF(items);
    return out;
}

/* Bytes of a line an error quotes, as the wire listener quotes a PREFILL's: a peer's long line
   must not make a long error. */
#define QUOTED_BYTES 64

/* Adds one header line to the dict; a later line with the same key replaces an earlier one. */
static int decode_line(PyObject *fields, const char *line, size_t len)
{
    const char *eq = memchr(line, '=', len);
    if (eq == NULL) {
        size_t shown = len < QUOTED_BYTES ? len : QUOTED_BYTES;
        while (shown > 0 && shown < len && ((unsigned char)line[shown] & 0xC0) == 0x80)
            shown--; /* the quote ends on a whole UTF-8 character (the header is UTF-8) */
        PyObject *text = PyUnicode_DecodeUTF8(line, (Py_ssize_t)shown, "strict");
        if (text != NULL) {
            PyErr_Format(epd_MsgError, "a header line without '=': \"%U%s\"", text, len > QUOTED_BYTES ? "..." : "");
            Py_DECREF(text);
        }
        return -1;
    }
    PyObject *key = PyUnicode_DecodeUTF8(line, eq - line, "strict");
    PyObject *value = PyUnicode_DecodeUTF8(eq + 1, (Py_ssize_t)(len - (size_t)(eq - line) - 1), "strict");
    int rc = (key == NULL || value == NULL) ? -1 : PyDict_SetItem(fields, key, value);
    Py_XDECREF(key);
    Py_XDECREF(value);
    return rc;
}

/* The header ends at the first empty line (a '\n' that starts a line); without one the
   whole message is header and the body is empty. The header must be UTF-8 as a whole
   (checked before any line); the body is raw bytes. */
PyObject *epd_msg_decode(Py_buffer *data)
{
    const char *p = data->buf;
    size_t n = (size_t)data->len;
    size_t header_len = n, body_at = n;
    if (n > 0 && p[0] == '\n') {
        header_len = 0;
        body_at = 1;
    } else {
        for (size_t i = 0; i + 1 < n; i++) {
            if (p[i] == '\n' && p[i + 1] == '\n') {
                header_len = i + 1;
                body_at = i + 2;
                break;
            }
        }
    }
    PyObject *check = PyUnicode_DecodeUTF8(p, (Py_ssize_t)header_len, "strict");
    if (check == NULL) {
        if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
            PyErr_Clear();
            PyErr_SetString(epd_MsgError, "a message that is not UTF-8");
        }
        return NULL;
    }
    Py_DECREF(check);
    PyObject *fields = PyDict_New();
    if (fields == NULL)
        return NULL;
    size_t at = 0;
    while (at < header_len) {
        const char *nl = memchr(p + at, '\n', header_len - at);
        size_t end = nl ? (size_t)(nl - p) : header_len;
        if (decode_line(fields, p + at, end - at) < 0) {
            Py_DECREF(fields);
            return NULL;
        }
        at = end + 1;
    }
    PyObject *body = PyBytes_FromStringAndSize(p + body_at, (Py_ssize_t)(n - body_at));
    if (body == NULL) {
        Py_DECREF(fields);
        return NULL;
    }
    return Py_BuildValue("(NN)", fields, body);
}
