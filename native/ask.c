/* The asks an encode driver reads off its request socket, parsed in one call.
 *
 * The rule is transfer/frames.py's `TransferInfo._from_plain_frames`, which the unit suite holds
 * this file to: 13 bytes parts (SPEC.md 4.2), or 14 with our part 13; the eight numbers plain
 * ASCII digits (at most 160 in all, each at most 2^63 - 1, the port at most 65535), the three
 * texts ASCII, the two pointers 8 bytes each in host order, part 9 true exactly when it is "1".
 * Anything else is not a plain ask: it goes the general path (registrations, cancels, a peer's
 * longer asks, and whatever is malformed), which parses it strictly.
 */
#include "epd.h"

#include <string.h>

#define ASK_PARTS 13
#define ASK_MAX_DIGITS 160 /* all eight numbers together, as _PLAIN_DIGITS */
#define ASK_FIELDS 14

/* Parts 0-12 by meaning, and where each number goes among the eight. */
enum { P_ROOM, P_ENDPOINT, P_PORT, P_SESSION, P_EMB, P_DS, P_ROWS, P_HIDDEN, P_DTYPE, P_HAS_DS, P_FANOUT,
       P_ROW_START, P_SPAN, P_WIDTH };

static const int number_parts[] = {P_ROOM, P_PORT, P_ROWS, P_HIDDEN, P_FANOUT, P_ROW_START, P_SPAN, P_WIDTH};
#define NUMBERS (sizeof(number_parts) / sizeof(number_parts[0]))

/* A part of 1 or more ASCII digits worth at most 2^63 - 1 into *value; its digits are added to *digits.
 * 0 when it is not. */
static int plain_i64(PyObject *part, Py_ssize_t *digits, long long *value)
{
    Py_ssize_t n = PyBytes_GET_SIZE(part);
    const unsigned char *s = (const unsigned char *)PyBytes_AS_STRING(part);
    if (n == 0)
        return 0;
    unsigned long long v = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9')
            return 0;
        unsigned d = s[i] - '0';
        if (v > ((unsigned long long)INT64_MAX - d) / 10)
            return 0; /* past 2^63 - 1 */
        v = v * 10 + d;
    }
    *digits += n;
    *value = (long long)v;
    return 1;
}

/* An ASCII text part as str, or NULL: with *failed set when that was an error (not merely non-ASCII). */
static PyObject *ascii_text(PyObject *part, int *failed)
{
    Py_ssize_t n = PyBytes_GET_SIZE(part);
    const unsigned char *s = (const unsigned char *)PyBytes_AS_STRING(part);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (s[i] > 0x7f)
            return NULL;
    }
    PyObject *text = PyUnicode_DecodeASCII((const char *)s, n, "strict");
    if (text == NULL)
        *failed = 1;
    return text;
}

/* A plain ask's TransferInfo (cls called with its fields), Py_None when `parts` is not one, NULL with an
 * exception set. */
static PyObject *plain_ask(PyObject *parts, PyObject *cls)
{
    if (!PyList_CheckExact(parts))
        Py_RETURN_NONE;
    Py_ssize_t count = PyList_GET_SIZE(parts);
    if (count != ASK_PARTS && count != ASK_PARTS + 1)
        Py_RETURN_NONE;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!PyBytes_CheckExact(PyList_GET_ITEM(parts, i)))
            Py_RETURN_NONE;
    }
    long long number[NUMBERS];
    Py_ssize_t digits = 0;
    number[NUMBERS - 1] = 0;
    for (size_t i = 0; i < NUMBERS; i++) {
        if (number_parts[i] >= count) {
            digits += 1; /* part 13 absent: counted as "0", as the Python rule does, and not kept */
            continue;
        }
        if (!plain_i64(PyList_GET_ITEM(parts, number_parts[i]), &digits, &number[i]))
            Py_RETURN_NONE;
    }
    PyObject *emb = PyList_GET_ITEM(parts, P_EMB), *ds = PyList_GET_ITEM(parts, P_DS);
    if (digits > ASK_MAX_DIGITS || number[1] > 0xFFFF || PyBytes_GET_SIZE(emb) != 8 || PyBytes_GET_SIZE(ds) != 8)
        Py_RETURN_NONE;
    uint64_t emb_ptr, ds_ptr;
    memcpy(&emb_ptr, PyBytes_AS_STRING(emb), 8);
    memcpy(&ds_ptr, PyBytes_AS_STRING(ds), 8);
    PyObject *has_ds = PyList_GET_ITEM(parts, P_HAS_DS);
    int deep = PyBytes_GET_SIZE(has_ds) == 1 && PyBytes_AS_STRING(has_ds)[0] == '1';

    PyObject *fields[ASK_FIELDS] = {NULL};
    PyObject *out = NULL;
    int failed = 0;
    int texts[] = {P_ENDPOINT, P_SESSION, P_DTYPE};
    for (int i = 0; i < 3; i++) {
        fields[texts[i]] = ascii_text(PyList_GET_ITEM(parts, texts[i]), &failed);
        if (fields[texts[i]] == NULL)
            goto done; /* non-ASCII: the strict parser says so; or an error (failed) */
    }
    fields[P_ROOM] = PyLong_FromLongLong(number[0]);
    fields[P_PORT] = PyLong_FromLongLong(number[1]);
    fields[P_ROWS] = PyLong_FromLongLong(number[2]);
    fields[P_HIDDEN] = PyLong_FromLongLong(number[3]);
    fields[P_FANOUT] = PyLong_FromLongLong(number[4]);
    fields[P_ROW_START] = PyLong_FromLongLong(number[5]);
    fields[P_SPAN] = PyLong_FromLongLong(number[6]);
    fields[P_WIDTH] = count > ASK_PARTS ? PyLong_FromLongLong(number[7]) : Py_NewRef(Py_None);
    fields[P_EMB] = PyLong_FromUnsignedLongLong(emb_ptr);
    fields[P_DS] = PyLong_FromUnsignedLongLong(ds_ptr);
    fields[P_HAS_DS] = Py_NewRef(deep ? Py_True : Py_False);
    for (int i = 0; i < ASK_FIELDS; i++) {
        if (fields[i] == NULL) {
            failed = 1;
            goto done;
        }
    }
    out = PyObject_Vectorcall(cls, fields, ASK_FIELDS, NULL);
done:
    for (int i = 0; i < ASK_FIELDS; i++)
        Py_XDECREF(fields[i]);
    if (out == NULL && !failed && !PyErr_Occurred())
        Py_RETURN_NONE;
    return out;
}

/* ask_parse(parts, cls) -> cls(...) of a plain ask, or None (see plain_ask). */
PyObject *epd_ask_parse(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *parts, *cls;
    if (!PyArg_ParseTuple(args, "OO", &parts, &cls))
        return NULL;
    return plain_ask(parts, cls);
}

/* An epd_taker: a plain ask's TransferInfo onto `asks`. */
static int take_ask(void *cls, PyObject *message, PyObject *asks)
{
    PyObject *ask = plain_ask(message, cls);
    if (ask == NULL)
        return -1;
    if (ask == Py_None) {
        Py_DECREF(ask);
        return 0;
    }
    int appended = PyList_Append(asks, ask);
    Py_DECREF(ask);
    return appended < 0 ? -1 : 1;
}

/* ask_take(handle, cls, most, max_bytes=0, max_parts=0) -> (asks, message, empty).
 *
 * Reads at most `most` messages off the socket without blocking, parsing each plain ask into cls(...)
 * (`asks`, in order), up to the first message that is not one (`message`): see epd_zmq_take. A class
 * that raises leaves the message to the general path. */
PyObject *epd_ask_take(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *handle_obj, *cls;
    Py_ssize_t most, max_bytes = 0, max_parts = 0;
    if (!PyArg_ParseTuple(args, "OOn|nn", &handle_obj, &cls, &most, &max_bytes, &max_parts))
        return NULL;
    return epd_zmq_take(handle_obj, most, max_bytes, max_parts, take_ask, cls);
}

/* ---------------------------------------------------------------- the asks a prefill rank sends
 *
 * The rule is transfer/frames.py's `TransferInfo.to_frames` in its plain case, which the unit suite holds
 * this encoder to: the nine numbers exact ints in range (the room and port not negative, the port at most
 * 65535, the pointers u64, the rest i64), the three texts exact ASCII strs, part 13 absent (None) or an
 * exact int in [0, 2^63 - 1]. Numbers go as decimal ASCII, the pointers as 8 bytes in host order, part 9
 * as "1" or "0". Anything else (a bool or an IntEnum among the numbers, a str subclass, a has_deepstack
 * that is not True or False, an instance of another class) is not a plain ask: the Python encoder takes it.
 */

/* The fields in part order, then part 13's. */
static const char *const ask_field_names[ASK_FIELDS] = {
    "room", "endpoint", "port", "session_id", "embedding_ptr", "deepstack_ptr", "rows", "hidden", "dtype",
    "has_deepstack", "fanout", "row_start", "span", "deepstack_row_bytes"};
static PyObject *ask_keys[ASK_FIELDS];

/* An ask's parts, pointing into its fields' texts (held in `fields`) and into `digits`. */
struct ask_parts {
    const char *data[ASK_FIELDS];
    size_t len[ASK_FIELDS];
    Py_ssize_t count;
    char digits[ASK_FIELDS * 24];
    PyObject *fields[ASK_FIELDS];
};

/* Lets go of the fields encode_ask held. */
static void release_ask(struct ask_parts *parts)
{
    for (int i = 0; i < ASK_FIELDS; i++)
        Py_CLEAR(parts->fields[i]);
}

/* v as decimal ASCII at out (at most 20 bytes); its length. */
static size_t put_i64(char *out, long long v)
{
    char tmp[24];
    size_t n = 0;
    unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    do {
        tmp[n++] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    size_t len = 0;
    if (v < 0)
        out[len++] = '-';
    while (n)
        out[len++] = tmp[--n];
    return len;
}

/* An exact int within [lo, hi] into *v: 1, or 0 when it is not one. */
static int exact_i64(PyObject *obj, long long lo, long long hi, long long *v)
{
    if (obj == NULL || !PyLong_CheckExact(obj))
        return 0;
    int overflow;
    *v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (*v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return !overflow && *v >= lo && *v <= hi;
}

/* An exact int within [0, 2^64 - 1] into *v: 1, or 0 when it is not one. */
static int exact_u64(PyObject *obj, unsigned long long *v)
{
    if (obj == NULL || !PyLong_CheckExact(obj))
        return 0;
    *v = PyLong_AsUnsignedLongLong(obj);
    if (*v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear(); /* negative, or past 2^64 - 1 */
        return 0;
    }
    return 1;
}

/* An exact ASCII str's bytes: 1, or 0 when it is not one. */
static int exact_ascii(PyObject *obj, const char **data, size_t *len)
{
    if (obj == NULL || !PyUnicode_CheckExact(obj) || !PyUnicode_IS_ASCII(obj))
        return 0;
    *data = (const char *)PyUnicode_DATA(obj);
    *len = (size_t)PyUnicode_GET_LENGTH(obj);
    return 1;
}

/* The parts of `info`, an instance of exactly `cls` (TransferInfo): 1; 0 when it is not a plain ask; -1 with
 * an exception set. Whatever it returns, the caller calls release_ask once done with the parts, which point
 * into the field values `out` holds. */
static int encode_ask(PyObject *info, PyObject *cls, struct ask_parts *out)
{
    for (int i = 0; i < ASK_FIELDS; i++)
        out->fields[i] = NULL;
    if ((PyObject *)Py_TYPE(info) != cls)
        return 0;
    if (ask_keys[0] == NULL) {
        for (int i = 0; i < ASK_FIELDS; i++) {
            if ((ask_keys[i] = PyUnicode_InternFromString(ask_field_names[i])) == NULL)
                return -1;
        }
    }
    PyObject *dict = PyObject_GenericGetDict(info, NULL);
    if (dict == NULL)
        return -1;
    /* Each value held as soon as it is found: a later lookup may compare a key of the dict's with Python code
       (a str subclass's __eq__), which can change the dict and drop the values it held. */
    PyObject **field = out->fields;
    int found = PyDict_CheckExact(dict);
    for (int i = 0; found && i < ASK_FIELDS; i++) {
        field[i] = Py_XNewRef(PyDict_GetItemWithError(dict, ask_keys[i]));
        found = field[i] != NULL;
    }
    Py_DECREF(dict);
    if (!found)
        return PyErr_Occurred() ? -1 : 0;
    static const int signed_parts[] = {P_ROWS, P_HIDDEN, P_FANOUT, P_ROW_START, P_SPAN};
    long long number;
    char *digits = out->digits;
    if (!exact_i64(field[P_ROOM], 0, INT64_MAX, &number))
        return 0;
    out->data[P_ROOM] = digits;
    out->len[P_ROOM] = put_i64(digits, number);
    digits += 24;
    if (!exact_i64(field[P_PORT], 0, 0xFFFF, &number))
        return 0;
    out->data[P_PORT] = digits;
    out->len[P_PORT] = put_i64(digits, number);
    digits += 24;
    for (size_t i = 0; i < sizeof(signed_parts) / sizeof(signed_parts[0]); i++) {
        if (!exact_i64(field[signed_parts[i]], INT64_MIN, INT64_MAX, &number))
            return 0;
        out->data[signed_parts[i]] = digits;
        out->len[signed_parts[i]] = put_i64(digits, number);
        digits += 24;
    }
    int pointers[] = {P_EMB, P_DS};
    for (int i = 0; i < 2; i++) {
        unsigned long long ptr;
        if (!exact_u64(field[pointers[i]], &ptr))
            return 0;
        uint64_t word = ptr;
        memcpy(digits, &word, 8); /* struct's "=Q": host order */
        out->data[pointers[i]] = digits;
        out->len[pointers[i]] = 8;
        digits += 24;
    }
    int texts[] = {P_ENDPOINT, P_SESSION, P_DTYPE};
    for (int i = 0; i < 3; i++) {
        if (!exact_ascii(field[texts[i]], &out->data[texts[i]], &out->len[texts[i]]))
            return 0;
    }
    if (field[P_HAS_DS] != Py_True && field[P_HAS_DS] != Py_False)
        return 0;
    out->data[P_HAS_DS] = field[P_HAS_DS] == Py_True ? "1" : "0";
    out->len[P_HAS_DS] = 1;
    out->count = ASK_PARTS;
    if (field[P_WIDTH] != Py_None) {
        if (!exact_i64(field[P_WIDTH], 0, INT64_MAX, &number))
            return 0;
        out->data[P_WIDTH] = digits;
        out->len[P_WIDTH] = put_i64(digits, number);
        out->count = ASK_PARTS + 1;
    }
    return 1;
}

/* ask_frames(info, cls) -> the parts of a plain ask as a list of bytes, or None when it is not one. */
PyObject *epd_ask_frames(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *info, *cls;
    if (!PyArg_ParseTuple(args, "OO", &info, &cls))
        return NULL;
    struct ask_parts parts;
    int plain = encode_ask(info, cls, &parts);
    if (plain <= 0) {
        release_ask(&parts);
        return plain < 0 ? NULL : Py_NewRef(Py_None);
    }
    PyObject *out = PyList_New(parts.count);
    for (Py_ssize_t i = 0; out != NULL && i < parts.count; i++) {
        PyObject *part = PyBytes_FromStringAndSize(parts.data[i], (Py_ssize_t)parts.len[i]);
        if (part == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, part);
    }
    release_ask(&parts);
    return out;
}

/* ask_send(handle, info, cls) -> True once a plain ask's parts are queued as one message, as zmq_send_parts
 * queues them (OSError with libzmq's errno when not: EAGAIN, nothing queued); None when it is not a plain
 * ask (nothing sent). */
PyObject *epd_ask_send(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *handle_obj, *info, *cls;
    if (!PyArg_ParseTuple(args, "OOO", &handle_obj, &info, &cls))
        return NULL;
    void *handle = PyLong_AsVoidPtr(handle_obj);
    if (handle == NULL && PyErr_Occurred())
        return NULL;
    struct ask_parts parts;
    int plain = encode_ask(info, cls, &parts);
    if (plain <= 0) {
        release_ask(&parts);
        return plain < 0 ? NULL : Py_NewRef(Py_None);
    }
    int sent = epd_zmq_send_spans(handle, parts.data, parts.len, parts.count);
    release_ask(&parts);
    if (sent < 0)
        return NULL;
    Py_RETURN_TRUE;
}
