/* cdcflow._speedups: cdcflow's hot loops in C, optional (built at install by setup.py).
 *
 * The compiled twins of two Python loops, which stay the reference: cdcflow.compiled
 * decides whether this module is used, and its callers fall back to Python for anything
 * it declines. It imports nothing of cdcflow: configure() and configure_walk() hand over
 * every Python object it uses, once.
 *
 * decode(token, strings, bools, lists, planner, sizes): GoogleSQL data change records
 * from their wire fields, as cdcflow.spanner.records.DataBuilder.run makes them (no
 * filter). It takes a merged run of data change records as cdcflow.spanner.flat gives it:
 * 9 strings, 2 bools and 2 serialized lists (column types, mods) per record, and returns
 * the list of DataChangeRecords, or None when the input is not that plain shape (a NULL
 * where a text belongs, an unexpected field): the caller then decodes it in Python. An
 * exception (a value that is not its column's wire form, invalid JSON) propagates; the
 * caller decodes the run in Python again, whose errors name the column. Records are made
 * field for field as the Python path makes them: mods' JSON objects are parsed by a small
 * parser for the flat objects Spanner writes (any text it does not handle goes to
 * orjson), values are typed by the plan's converters (INT64, FLOAT64, NUMERIC, JSON and
 * TIMESTAMP natively, any other by calling it), and the attrs classes' slots are set
 * directly, as their __init__ would (their converters are no-ops for these values).
 *
 * non_finite(value): cdcflow.serialize's check for a float that is not finite inside a
 * value (its dicts, lists and tuples; anything else is asked of a Python callable), and
 * json_default(value), its orjson default for the two types every change record holds
 * (a Timestamp's cached RFC 3339 text, a Decimal's positional text; anything else goes to
 * Python).
 *
 * json_line(element): cdcflow.serialize.dumps_line's JSONL line in one pass, or None for
 * what it leaves to the Python path (see its comment).
 *
 * Thread-safe under the GIL: between calls it keeps only what the configure functions set
 * and two caches (column names, the last timestamp), each read and replaced while holding
 * the GIL, with no Python code run in between.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <datetime.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* --- what configure() sets ------------------------------------------------------------ */

static PyObject *g_loads;        /* orjson.loads */
static PyObject *g_parse_ts;     /* values.parse_timestamp (also the TIMESTAMP converter) */
static PyObject *g_numeric;      /* the NUMERIC converter (values._numeric) */
static PyObject *g_json;         /* the JSON converter (values._json) */
static PyObject *g_decimal;      /* decimal.Decimal */
static PyObject *g_json_string;  /* model.JsonString */
static PyTypeObject *g_mod, *g_record, *g_timestamp;
static PyObject *g_mod_slots[3];      /* keys, new_values, old_values */
static PyObject *g_record_slots[15];  /* DataChangeRecord's fields, in order */
static PyObject *g_ts_slots[3];       /* Timestamp's _nanosecond, _ns, _text */
static Py_ssize_t g_record_bytes, g_entry_bytes;
static PyObject *g_no_args;

/* The last timestamp made and its text: a record's values often repeat its commit time. */
static PyObject *g_last_text, *g_last_ts;

static int set_slot(PyObject *descr, PyObject *obj, PyObject *value) {
    return Py_TYPE(descr)->tp_descr_set(descr, obj, value);
}

static int get_slots(PyTypeObject *type, PyObject *names, PyObject **out, Py_ssize_t n) {
    if (!PyTuple_Check(names) || PyTuple_GET_SIZE(names) != n) {
        PyErr_Format(PyExc_TypeError, "%s: expected a tuple of %zd slot names", type->tp_name, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        PyObject *descr = PyDict_GetItemWithError(type->tp_dict, name);
        if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_TypeError, "%s.%S is not a slot", type->tp_name, name);
            return -1;
        }
        Py_XSETREF(out[i], Py_NewRef(descr));
    }
    return 0;
}

static void keep(PyObject **where, PyObject *value) { Py_XSETREF(*where, Py_NewRef(value)); }

static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *loads, *parse_ts, *numeric, *json, *decimal, *json_string;
    PyObject *mod_names, *record_names, *ts_names;
    PyTypeObject *mod, *record, *timestamp;
    Py_ssize_t record_bytes, entry_bytes;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOOOO!OO!OO!Onn", &loads, &parse_ts, &numeric, &json,
                          &decimal, &json_string, &PyType_Type, &mod, &mod_names,
                          &PyType_Type, &record, &record_names, &PyType_Type, &timestamp,
                          &ts_names, &record_bytes, &entry_bytes))
        return NULL;
    if (!PyType_IsSubtype(timestamp, PyDateTimeAPI->DateTimeType)) {
        PyErr_SetString(PyExc_TypeError, "the timestamp class must subclass datetime");
        return NULL;
    }
    if (get_slots(mod, mod_names, g_mod_slots, 3) < 0
        || get_slots(record, record_names, g_record_slots, 15) < 0
        || get_slots(timestamp, ts_names, g_ts_slots, 3) < 0)
        return NULL;
    keep(&g_loads, loads);
    keep(&g_parse_ts, parse_ts);
    keep(&g_numeric, numeric);
    keep(&g_json, json);
    keep(&g_decimal, decimal);
    keep(&g_json_string, json_string);
    keep((PyObject **)&g_mod, (PyObject *)mod);
    keep((PyObject **)&g_record, (PyObject *)record);
    keep((PyObject **)&g_timestamp, (PyObject *)timestamp);
    g_record_bytes = record_bytes;
    g_entry_bytes = entry_bytes;
    Py_CLEAR(g_last_text);
    Py_CLEAR(g_last_ts);
    Py_RETURN_NONE;
}

/* --- timestamps ----------------------------------------------------------------------- */

static int ascii_digits(const char *p, int n) {
    int v = 0;
    for (int i = 0; i < n; i++) {
        if (p[i] < '0' || p[i] > '9') return -1;
        v = v * 10 + (p[i] - '0');
    }
    return v;
}

/* Days from 1970-01-01 to a proleptic Gregorian date (the days_from_civil algorithm). */
static int64_t days_from_civil(int64_t y, int64_t m, int64_t d) {
    y -= m <= 2;
    int64_t era = (y >= 0 ? y : y - 399) / 400;
    int64_t yoe = y - era * 400;
    int64_t doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
    int64_t doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + doe - 719468;
}

/* Spanner's form of a timestamp, "YYYY-MM-DDTHH:MM:SS[.f{1,9}]Z" in ASCII digits, as the
 * Timestamp values.parse_timestamp makes of it. NULL without an error for any other text
 * (or one the datetime type refuses): the caller then asks parse_timestamp. */
static PyObject *spanner_timestamp(PyObject *text) {
    Py_ssize_t n;
    const char *p = PyUnicode_AsUTF8AndSize(text, &n);
    if (p == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (n < 20 || p[n - 1] != 'Z' || p[4] != '-' || p[7] != '-' || p[10] != 'T' || p[13] != ':'
        || p[16] != ':')
        return NULL;
    int year = ascii_digits(p, 4), month = ascii_digits(p + 5, 2), day = ascii_digits(p + 8, 2);
    int hour = ascii_digits(p + 11, 2), minute = ascii_digits(p + 14, 2);
    int second = ascii_digits(p + 17, 2);
    if (year < 0 || month < 0 || day < 0 || hour < 0 || minute < 0 || second < 0) return NULL;
    int frac = 0, nd = 0;
    if (n > 20) {
        nd = (int)(n - 21);
        if (p[19] != '.' || nd < 1 || nd > 9) return NULL;
        frac = ascii_digits(p + 20, nd);
        if (frac < 0) return NULL;
        for (int i = nd; i < 9; i++) frac *= 10;
    }
    PyObject *ts = PyDateTimeAPI->DateTime_FromDateAndTime(
        year, month, day, hour, minute, second, frac / 1000, PyDateTime_TimeZone_UTC,
        g_timestamp);
    if (ts == NULL) {
        PyErr_Clear(); /* parse_timestamp says what is wrong with it */
        return NULL;
    }
    /* |seconds| <= 2.6e11 for years 0001-9999: the nanoseconds need 128 bits of room. */
    int64_t secs = days_from_civil(year, month, day) * 86400 + hour * 3600 + minute * 60 + second;
    PyObject *ns = NULL;
    if (secs > -9000000000LL && secs < 9000000000LL) {
        ns = PyLong_FromLongLong(secs * 1000000000LL + frac);
    } else {
        PyObject *s = PyLong_FromLongLong(secs), *giga = PyLong_FromLong(1000000000L);
        PyObject *f = PyLong_FromLong(frac), *scaled = NULL;
        if (s && giga && f) scaled = PyNumber_Multiply(s, giga);
        if (scaled) ns = PyNumber_Add(scaled, f);
        Py_XDECREF(s);
        Py_XDECREF(giga);
        Py_XDECREF(f);
        Py_XDECREF(scaled);
    }
    PyObject *nano = PyLong_FromLong(frac % 1000);
    /* _text caches rfc3339(): Spanner's usual form (nine digits, Z) is already it. */
    int bad = ns == NULL || nano == NULL || set_slot(g_ts_slots[0], ts, nano) < 0
              || set_slot(g_ts_slots[1], ts, ns) < 0
              || set_slot(g_ts_slots[2], ts, nd == 9 ? text : Py_None) < 0;
    Py_XDECREF(ns);
    Py_XDECREF(nano);
    if (bad) {
        Py_DECREF(ts);
        return NULL;
    }
    return ts;
}

static PyObject *timestamp(PyObject *text) {
    PyObject *last = g_last_text;
    if (last != NULL && (last == text || (PyUnicode_GET_LENGTH(last) == PyUnicode_GET_LENGTH(text)
                                          && PyUnicode_Compare(last, text) == 0)))
        return Py_NewRef(g_last_ts);
    PyObject *ts = spanner_timestamp(text);
    if (ts == NULL) {
        if (PyErr_Occurred()) return NULL;
        return PyObject_CallOneArg(g_parse_ts, text);
    }
    Py_XSETREF(g_last_ts, Py_NewRef(ts));
    Py_XSETREF(g_last_text, Py_NewRef(text));
    return ts;
}

/* --- typing a value ------------------------------------------------------------------- */

/* A parse the fast parser declines (not an error): the text goes to orjson. */
#define DECLINE ((PyObject *)1)

static PyObject *json_text(PyObject *text);

/* Whether text holds 19 digits in a row: an integer that may not fit 64 bits, which
 * orjson makes a float; the JSON converter (Python) then keeps it exact. */
static int long_digit_run(PyObject *text) {
    Py_ssize_t n;
    const char *p = PyUnicode_AsUTF8AndSize(text, &n);
    if (p == NULL) {
        PyErr_Clear();
        return 1; /* the converter says what is wrong with it */
    }
    int run = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        run = (p[i] >= '0' && p[i] <= '9') ? run + 1 : 0;
        if (run >= 19) return 1;
    }
    return 0;
}

/* What converter conv makes of value; the converters of cdcflow.spanner.values that the
 * decoder inlines are done here without a Python call, with the same result. */
static PyObject *convert(PyObject *conv, PyObject *value) {
    if (PyUnicode_CheckExact(value)) {
        if (conv == (PyObject *)&PyLong_Type) return PyLong_FromUnicodeObject(value, 10);
        if (conv == (PyObject *)&PyFloat_Type) return PyFloat_FromString(value);
        if (conv == g_numeric) return PyObject_CallOneArg(g_decimal, value);
        if (conv == g_parse_ts) return timestamp(value);
        if (conv == g_json && !long_digit_run(value)) {
            PyObject *parsed = json_text(value);
            if (parsed == DECLINE) parsed = PyObject_CallOneArg(g_loads, value);
            if (parsed == NULL || !PyUnicode_CheckExact(parsed)) return parsed;
            PyObject *marked = PyObject_CallOneArg(g_json_string, parsed);
            Py_DECREF(parsed);
            return marked;
        }
    }
    return PyObject_CallOneArg(conv, value);
}

/* cdcflow.spanner.values.decode_values: a new dict of values (a dict, or any mapping) with
 * each value that is not None converted by its column's converter in convs (a dict); with
 * no converters, values itself (a dict) or a plain copy. Raises what a converter raises. */
static PyObject *decode_values(PyObject *self, PyObject *args) {
    PyObject *values, *convs;
    (void)self;
    if (!PyArg_ParseTuple(args, "OO!", &values, &PyDict_Type, &convs)) return NULL;
    PyObject *source;
    if (PyDict_Check(values)) {
        source = Py_NewRef(values);
    } else {
        source = PyDict_New();
        if (source == NULL) return NULL;
        if (PyDict_Update(source, values) < 0) {
            Py_DECREF(source);
            return NULL;
        }
    }
    if (PyDict_GET_SIZE(convs) == 0) {
        if (PyDict_CheckExact(source)) return source;
        PyObject *copy = PyDict_Copy(source);
        Py_DECREF(source);
        return copy;
    }
    PyObject *out = PyDict_New();
    if (out == NULL) goto fail;
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(source, &pos, &key, &value)) {
        PyObject *typed;
        PyObject *conv = value == Py_None ? NULL : PyDict_GetItemWithError(convs, key);
        if (conv != NULL) {
            /* a converter runs Python code that may change the dict: hold what is used */
            Py_INCREF(key);
            Py_INCREF(value);
            Py_INCREF(conv);
            typed = convert(conv, value);
            Py_DECREF(conv);
            Py_DECREF(value);
        } else if (PyErr_Occurred()) {
            goto fail;
        } else {
            Py_INCREF(key);
            typed = Py_NewRef(value);
        }
        int r = typed == NULL ? -1 : PyDict_SetItem(out, key, typed);
        Py_DECREF(key);
        Py_XDECREF(typed);
        if (r < 0) goto fail;
    }
    Py_DECREF(source);
    return out;
fail:
    Py_DECREF(source);
    Py_XDECREF(out);
    return NULL;
}

/* --- the flat JSON objects of mods ---------------------------------------------------- */


typedef struct {
    const char *p, *end;
} Cursor;

static void skip_ws(Cursor *c) {
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r'))
        c->p++;
}

/* Column names repeat in every mod: a small direct-mapped cache of their str objects. */
#define KEY_CACHE 256
#define KEY_MAX 64
static struct {
    Py_ssize_t len;
    char bytes[KEY_MAX];
    PyObject *str;
} key_cache[KEY_CACHE];

static PyObject *cached_key(const char *s, Py_ssize_t len) {
    if (len > KEY_MAX) return PyUnicode_DecodeUTF8(s, len, NULL);
    uint32_t h = 2166136261u;
    for (Py_ssize_t i = 0; i < len; i++) h = (h ^ (unsigned char)s[i]) * 16777619u;
    h %= KEY_CACHE;
    if (key_cache[h].str != NULL && key_cache[h].len == len && memcmp(key_cache[h].bytes, s, len) == 0)
        return Py_NewRef(key_cache[h].str);
    PyObject *str = PyUnicode_DecodeUTF8(s, len, NULL);
    if (str == NULL) return NULL;
    Py_XSETREF(key_cache[h].str, Py_NewRef(str));
    key_cache[h].len = len;
    memcpy(key_cache[h].bytes, s, len);
    return str;
}

/* A JSON string without escapes at c->p (the opening quote): its span; 0 (declined) when
 * it has an escape or does not end. */
static int plain_string(Cursor *c, const char **s, Py_ssize_t *len) {
    const char *q = c->p + 1;
    while (q < c->end && *q != '"' && *q != '\\' && (unsigned char)*q >= 0x20) q++;
    if (q >= c->end || *q != '"') return 0;
    *s = c->p + 1;
    *len = q - *s;
    c->p = q + 1;
    return 1;
}

static int hex4(const char *p) {
    int v = 0;
    for (int i = 0; i < 4; i++) {
        char h = p[i];
        v <<= 4;
        if (h >= '0' && h <= '9') v |= h - '0';
        else if (h >= 'a' && h <= 'f') v |= h - 'a' + 10;
        else if (h >= 'A' && h <= 'F') v |= h - 'A' + 10;
        else return -1;
    }
    return v;
}

static char *put_utf8(char *o, uint32_t cp) {
    if (cp < 0x80) {
        *o++ = (char)cp;
    } else if (cp < 0x800) {
        *o++ = (char)(0xC0 | (cp >> 6));
        *o++ = (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        *o++ = (char)(0xE0 | (cp >> 12));
        *o++ = (char)(0x80 | ((cp >> 6) & 0x3F));
        *o++ = (char)(0x80 | (cp & 0x3F));
    } else {
        *o++ = (char)(0xF0 | (cp >> 18));
        *o++ = (char)(0x80 | ((cp >> 12) & 0x3F));
        *o++ = (char)(0x80 | ((cp >> 6) & 0x3F));
        *o++ = (char)(0x80 | (cp & 0x3F));
    }
    return o;
}

/* A JSON string at c->p (the opening quote) as a str, its escapes decoded; DECLINE for a
 * control character, a bad escape or a lone surrogate (orjson's to judge). */
static PyObject *parse_string(Cursor *c) {
    const char *s;
    Py_ssize_t len;
    Cursor save = *c;
    if (plain_string(c, &s, &len)) {
        PyObject *str = PyUnicode_DecodeUTF8(s, len, NULL);
        if (str == NULL) PyErr_Clear(); /* not UTF-8 */
        return str == NULL ? DECLINE : str;
    }
    *c = save;
    const char *q = c->p + 1, *end = c->p + 1;
    while (end < c->end && *end != '"') end += *end == '\\' ? 2 : 1;
    if (end >= c->end) return DECLINE; /* no closing quote */
    /* an escape never decodes longer than it is written: the string's length is room enough */
    char *buf = PyMem_Malloc(end - q + 1);
    if (buf == NULL) return PyErr_NoMemory();
    char *o = buf;
    int bad = 0;
    while (q < end && !bad) {
        unsigned char ch = (unsigned char)*q;
        if (ch < 0x20) {
            bad = 1;
        } else if (ch != '\\') {
            *o++ = (char)ch;
            q++;
        } else {
            char e = q[1]; /* the scan above saw a character after every backslash */
            q += 2;
            if (e == '"' || e == '\\' || e == '/') *o++ = e;
            else if (e == 'b') *o++ = '\b';
            else if (e == 'f') *o++ = '\f';
            else if (e == 'n') *o++ = '\n';
            else if (e == 'r') *o++ = '\r';
            else if (e == 't') *o++ = '\t';
            else if (e != 'u' || end - q < 4) bad = 1;
            else {
                int cp = hex4(q);
                q += 4;
                if (cp >= 0xD800 && cp <= 0xDBFF) { /* a high surrogate: its low one follows */
                    int low = end - q >= 6 && q[0] == '\\' && q[1] == 'u' ? hex4(q + 2) : -1;
                    if (low >= 0xDC00 && low <= 0xDFFF) {
                        q += 6;
                        cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
                    } else {
                        bad = 1;
                    }
                } else if (cp < 0 || (cp >= 0xDC00 && cp <= 0xDFFF)) {
                    bad = 1;
                }
                if (!bad) o = put_utf8(o, (uint32_t)cp);
            }
        }
    }
    PyObject *result = DECLINE;
    if (!bad) {
        PyObject *str = PyUnicode_DecodeUTF8(buf, o - buf, NULL);
        if (str == NULL) {
            PyErr_Clear(); /* not UTF-8 */
        } else {
            result = str;
            c->p = end + 1;
        }
    }
    PyMem_Free(buf);
    return result;
}

static PyObject *parse_value(Cursor *c, int depth);

static const char *digit_run(const char *q, const char *end) {
    while (q < end && *q >= '0' && *q <= '9') q++;
    return q;
}

/* A JSON number (-?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?) as orjson makes it: an int
 * when it has no fraction or exponent, else the nearest float. Declined: anything else,
 * ints past 18 digits and exponents past 99 (orjson's to judge). */
static PyObject *parse_number(Cursor *c) {
    const char *start = c->p, *q = c->p, *end = c->end;
    int is_float = 0;
    if (q < end && *q == '-') q++;
    if (q >= end || *q < '0' || *q > '9') return DECLINE;
    if (*q == '0') q++;
    else q = digit_run(q, end);
    Py_ssize_t int_digits = q - start - (*start == '-');
    if (q < end && *q == '.') {
        const char *f = digit_run(q + 1, end);
        if (f == q + 1) return DECLINE;
        q = f;
        is_float = 1;
    }
    if (q < end && (*q == 'e' || *q == 'E')) {
        q++;
        if (q < end && (*q == '+' || *q == '-')) q++;
        const char *e = digit_run(q, end);
        /* near the ends of the double range (overflow, denormals): orjson's to judge */
        if (e == q || e - q > 2) return DECLINE;
        q = e;
        is_float = 1;
    }
    Py_ssize_t len = q - start;
    char buf[64];
    if (len >= (Py_ssize_t)sizeof(buf) || (!is_float && int_digits > 18)) return DECLINE;
    memcpy(buf, start, len);
    buf[len] = '\0';
    c->p = q;
    if (!is_float) return PyLong_FromLongLong(strtoll(buf, NULL, 10));
    double d = PyOS_string_to_double(buf, NULL, NULL);
    if (d == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return DECLINE;
    }
    return PyFloat_FromDouble(d);
}

static PyObject *parse_array(Cursor *c, int depth) {
    c->p++; /* [ */
    PyObject *list = PyList_New(0);
    if (list == NULL) return NULL;
    skip_ws(c);
    if (c->p < c->end && *c->p == ']') {
        c->p++;
        return list;
    }
    for (;;) {
        PyObject *item = parse_value(c, depth + 1);
        if (item == NULL || item == DECLINE) {
            Py_DECREF(list);
            return item;
        }
        int r = PyList_Append(list, item);
        Py_DECREF(item);
        if (r < 0) {
            Py_DECREF(list);
            return NULL;
        }
        skip_ws(c);
        if (c->p < c->end && *c->p == ',') {
            c->p++;
            continue;
        }
        if (c->p < c->end && *c->p == ']') {
            c->p++;
            return list;
        }
        Py_DECREF(list);
        return DECLINE;
    }
}

static PyObject *parse_object(Cursor *c, int depth) {
    c->p++; /* { */
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    skip_ws(c);
    if (c->p < c->end && *c->p == '}') {
        c->p++;
        return d;
    }
    for (;;) {
        skip_ws(c);
        if (c->p >= c->end || *c->p != '"') break;
        PyObject *key = parse_string(c);
        if (key == NULL || key == DECLINE) {
            Py_DECREF(d);
            return key;
        }
        skip_ws(c);
        PyObject *value = DECLINE;
        if (c->p < c->end && *c->p == ':') {
            c->p++;
            value = parse_value(c, depth + 1);
        }
        /* a repeated name is orjson's to judge (the last one wins there) */
        if (value != NULL && value != DECLINE && PyDict_Contains(d, key)) {
            Py_DECREF(value);
            value = DECLINE;
        }
        int r = value == NULL || value == DECLINE ? -1 : PyDict_SetItem(d, key, value);
        Py_DECREF(key);
        if (value == NULL || value == DECLINE) {
            Py_DECREF(d);
            return value;
        }
        Py_DECREF(value);
        if (r < 0) {
            Py_DECREF(d);
            return NULL;
        }
        skip_ws(c);
        if (c->p < c->end && *c->p == ',') {
            c->p++;
            continue;
        }
        if (c->p < c->end && *c->p == '}') {
            c->p++;
            return d;
        }
        break;
    }
    Py_DECREF(d);
    return DECLINE;
}

/* A JSON value: a string, a number, true, false, null, an array or an object (a mod's
 * value, or a JSON column's text); declined: what parse_string and parse_number decline,
 * a repeated name, nesting deeper than 8. */
static PyObject *parse_value(Cursor *c, int depth) {
    skip_ws(c);
    if (c->p >= c->end || depth > 8) return DECLINE;
    switch (*c->p) {
    case '"':
        return parse_string(c);
    case '[':
        return parse_array(c, depth);
    case '{':
        return parse_object(c, depth);
    case 't':
        if (c->end - c->p >= 4 && memcmp(c->p, "true", 4) == 0) {
            c->p += 4;
            Py_RETURN_TRUE;
        }
        return DECLINE;
    case 'f':
        if (c->end - c->p >= 5 && memcmp(c->p, "false", 5) == 0) {
            c->p += 5;
            Py_RETURN_FALSE;
        }
        return DECLINE;
    case 'n':
        if (c->end - c->p >= 4 && memcmp(c->p, "null", 4) == 0) {
            c->p += 4;
            Py_RETURN_NONE;
        }
        return DECLINE;
    default:
        return parse_number(c);
    }
}

/* A JSON column's text parsed here, as orjson would; DECLINE: orjson's to parse. */
static PyObject *json_text(PyObject *text) {
    Py_ssize_t n;
    const char *p = PyUnicode_AsUTF8AndSize(text, &n);
    if (p == NULL) {
        PyErr_Clear(); /* a lone surrogate: orjson says what is wrong */
        return DECLINE;
    }
    Cursor c = {p, p + n};
    PyObject *value = parse_value(&c, 0);
    if (value == NULL || value == DECLINE) return value;
    skip_ws(&c);
    if (c.p != c.end) {
        Py_DECREF(value);
        return DECLINE;
    }
    return value;
}

/* The dict of one mod's JSON object text, typed by convs (NULL: wire values): parsed here
 * when the text is plain, else by orjson (and typed after). *entries grows by its size. */
static PyObject *mod_object(const char *text, Py_ssize_t len, PyObject *convs, Py_ssize_t *entries) {
    if (len == 0) return PyDict_New(); /* NULL: an empty map for the model */
    Cursor c = {text, text + len};
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    skip_ws(&c);
    if (c.p >= c.end || *c.p != '{') goto decline;
    c.p++;
    skip_ws(&c);
    if (c.p < c.end && *c.p == '}') {
        c.p++;
        goto done;
    }
    for (;;) {
        const char *s;
        Py_ssize_t klen;
        skip_ws(&c);
        if (c.p >= c.end || *c.p != '"' || !plain_string(&c, &s, &klen)) goto decline;
        skip_ws(&c);
        if (c.p >= c.end || *c.p != ':') goto decline;
        c.p++;
        PyObject *value = parse_value(&c, 0);
        if (value == DECLINE) goto decline;
        if (value == NULL) goto fail;
        PyObject *key = cached_key(s, klen);
        if (key == NULL) {
            Py_DECREF(value);
            PyErr_Clear();
            goto decline;
        }
        if (PyDict_Contains(d, key)) { /* a repeated name: orjson's rule, not ours */
            Py_DECREF(key);
            Py_DECREF(value);
            goto decline;
        }
        if (convs != NULL && value != Py_None) {
            PyObject *conv = PyDict_GetItemWithError(convs, key);
            if (conv != NULL) {
                Py_SETREF(value, convert(conv, value));
            } else if (PyErr_Occurred()) {
                Py_CLEAR(value);
            }
        }
        int r = value == NULL ? -1 : PyDict_SetItem(d, key, value);
        Py_DECREF(key);
        Py_XDECREF(value);
        if (r < 0) goto fail;
        skip_ws(&c);
        if (c.p < c.end && *c.p == ',') {
            c.p++;
            continue;
        }
        if (c.p < c.end && *c.p == '}') {
            c.p++;
            break;
        }
        goto decline;
    }
done:
    skip_ws(&c);
    if (c.p != c.end) goto decline;
    *entries += PyDict_GET_SIZE(d);
    return d;
decline:
    /* orjson parses it (or raises what is wrong with it); then the values are typed */
    Py_DECREF(d);
    {
        PyObject *mv = PyMemoryView_FromMemory((char *)text, len, PyBUF_READ);
        if (mv == NULL) return NULL;
        d = PyObject_CallOneArg(g_loads, mv);
        Py_DECREF(mv);
    }
    if (d == NULL) return NULL;
    if (!PyDict_CheckExact(d)) {
        Py_DECREF(d);
        return DECLINE;
    }
    *entries += PyDict_GET_SIZE(d);
    if (convs != NULL) {
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (PyDict_Next(d, &pos, &key, &value)) {
            if (value == Py_None) continue;
            PyObject *conv = PyDict_GetItemWithError(convs, key);
            if (conv == NULL) {
                if (PyErr_Occurred()) goto fail;
                continue;
            }
            PyObject *typed = convert(conv, value);
            /* replacing a value keeps the dict's keys: safe while iterating */
            int r = typed == NULL ? -1 : PyDict_SetItem(d, key, typed);
            Py_XDECREF(typed);
            if (r < 0) goto fail;
        }
    }
    return d;
fail:
    Py_DECREF(d);
    return NULL;
}

/* --- the serialized mods list ------------------------------------------------------------ */

static int read_varint(const unsigned char **p, const unsigned char *end, uint64_t *out) {
    uint64_t v = 0;
    for (int shift = 0; *p < end && shift < 64; shift += 7) {
        unsigned char b = *(*p)++;
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return 1;
        }
    }
    return 0;
}

/* The length-delimited field with tag `tag` at *p: its body [*body, *body_end); *p after. */
static int read_field(const unsigned char **p, const unsigned char *end, unsigned char tag,
                      const unsigned char **body, const unsigned char **body_end) {
    uint64_t len;
    if (*p >= end || **p != tag) return 0;
    (*p)++;
    if (!read_varint(p, end, &len) || len > (uint64_t)(end - *p)) return 0;
    *body = *p;
    *body_end = *p + len;
    *p = *body_end;
    return 1;
}

/* Walks a serialized ListValue of mods, each a Value holding a ListValue of three Values
 * (keys, new values, old values: a string, or NULL). */
typedef struct {
    const unsigned char *p, *end;
} ModWalk;

/* The next mod's three texts (a NULL's is empty); 1, 0 at the end, -1 if not that shape. */
static int next_mod(ModWalk *w, const char **texts, Py_ssize_t *lens) {
    const unsigned char *value, *value_end, *list, *list_end;
    if (w->p >= w->end) return 0;
    if (!read_field(&w->p, w->end, 0x0A, &value, &value_end)          /* ListValue.values */
        || !read_field(&value, value_end, 0x32, &list, &list_end)     /* Value.list_value */
        || value != value_end)
        return -1;
    int k = 0;
    while (list < list_end) {
        const unsigned char *e, *e_end;
        if (k == 3 || !read_field(&list, list_end, 0x0A, &e, &e_end)) return -1;
        texts[k] = (const char *)e;
        lens[k] = 0;
        if (e < e_end && *e == 0x1A) { /* Value.string_value */
            const unsigned char *s, *s_end;
            if (!read_field(&e, e_end, 0x1A, &s, &s_end) || e != e_end) return -1;
            texts[k] = (const char *)s;
            lens[k] = s_end - s;
        } else if (e < e_end && *e == 0x08) { /* Value.null_value */
            uint64_t ignored;
            e++;
            if (!read_varint(&e, e_end, &ignored) || e != e_end) return -1;
        } else if (e != e_end) {
            return -1;
        }
        k++;
    }
    return k == 3 ? 1 : -1;
}

/* --- records -------------------------------------------------------------------------- */

static PyObject *new_instance(PyTypeObject *type) { return type->tp_new(type, g_no_args, NULL); }

/* The mods of one record as a tuple of Mods; DECLINE if the list is not the plain shape. */
static PyObject *record_mods(PyObject *mods, PyObject *convs, Py_ssize_t *entries) {
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(mods);
    ModWalk w = {p, p + PyBytes_GET_SIZE(mods)};
    const char *texts[3];
    Py_ssize_t lens[3], count = 0;
    int more;
    while ((more = next_mod(&w, texts, lens)) == 1) count++;
    if (more < 0) return DECLINE;
    PyObject *out = PyTuple_New(count);
    if (out == NULL) return NULL;
    w.p = p;
    for (Py_ssize_t m = 0; m < count; m++) {
        next_mod(&w, texts, lens);
        PyObject *mod = new_instance(g_mod);
        if (mod == NULL) goto fail;
        PyTuple_SET_ITEM(out, m, mod);
        for (int k = 0; k < 3; k++) {
            PyObject *d = mod_object(texts[k], lens[k], convs, entries);
            if (d == DECLINE) {
                Py_DECREF(out);
                return DECLINE;
            }
            int r = d == NULL ? -1 : set_slot(g_mod_slots[k], mod, d);
            Py_XDECREF(d);
            if (r < 0) goto fail;
        }
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static int same_bytes(PyObject *a, PyObject *b) {
    return a == b || (PyBytes_GET_SIZE(a) == PyBytes_GET_SIZE(b)
                      && memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b), PyBytes_GET_SIZE(a)) == 0);
}

static PyObject *decode(PyObject *self, PyObject *args) {
    PyObject *token, *strings, *bools, *lists, *planner, *sizes;
    (void)self;
    if (!PyArg_ParseTuple(args, "UO!O!O!OO", &token, &PyList_Type, &strings, &PyList_Type, &bools,
                          &PyList_Type, &lists, &planner, &sizes))
        return NULL;
    if (g_record == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "cdcflow._speedups: configure() first");
        return NULL;
    }
    if (sizes != Py_None && !PyDict_CheckExact(sizes)) {
        PyErr_SetString(PyExc_TypeError, "sizes: a dict or None");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(bools) / 2;
    if (PyList_GET_SIZE(strings) != 9 * n || PyList_GET_SIZE(lists) != 2 * n
        || PyList_GET_SIZE(bools) != 2 * n)
        Py_RETURN_NONE;
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    /* each record's measure, given to sizes once every record is made (an error leaves
       sizes as it was: the records it would name are gone) */
    Py_ssize_t *measures = PyMem_Malloc(sizeof(Py_ssize_t) * (n ? n : 1));
    if (measures == NULL) {
        Py_DECREF(out);
        return PyErr_NoMemory();
    }
    /* the plan of the last table and column types (a run of one table repeats them) */
    PyObject *plan = NULL, *last_table = NULL, *last_columns = NULL;
    PyObject *columns = NULL, *convs = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject **s = &PyList_GET_ITEM(strings, 9 * i);
        PyObject *cols = PyList_GET_ITEM(lists, 2 * i), *mods = PyList_GET_ITEM(lists, 2 * i + 1);
        PyObject *last = PyList_GET_ITEM(bools, 2 * i), *system = PyList_GET_ITEM(bools, 2 * i + 1);
        PyObject *table = s[3];
        for (int k = 0; k < 9; k++)
            if (!PyUnicode_CheckExact(s[k])) goto decline;
        if (!PyBytes_CheckExact(cols) || !PyBytes_CheckExact(mods) || !PyBool_Check(last)
            || !PyBool_Check(system))
            goto decline;
        if (plan == NULL || PyUnicode_Compare(last_table, table) != 0 || !same_bytes(last_columns, cols)) {
            if (PyErr_Occurred()) goto fail;
            PyObject *found = PyObject_CallFunctionObjArgs(planner, table, cols, NULL);
            if (found == NULL) goto fail;
            if (!PyTuple_Check(found) || PyTuple_GET_SIZE(found) != 2
                || !PyTuple_Check(PyTuple_GET_ITEM(found, 0))) {
                Py_DECREF(found);
                PyErr_SetString(PyExc_TypeError, "planner: (a tuple of columns, converters)");
                goto fail;
            }
            Py_XSETREF(plan, found);
            columns = PyTuple_GET_ITEM(plan, 0);
            convs = PyTuple_GET_ITEM(plan, 1);
            if (convs == Py_None || (PyDict_Check(convs) && PyDict_GET_SIZE(convs) == 0))
                convs = NULL;
            else if (!PyDict_Check(convs)) {
                PyErr_SetString(PyExc_TypeError, "planner: converters must be a dict or None");
                goto fail;
            }
            last_table = table;
            last_columns = cols;
        }
        Py_ssize_t entries = 0;
        PyObject *mod_tuple = record_mods(mods, convs, &entries);
        if (mod_tuple == DECLINE) goto decline;
        if (mod_tuple == NULL) goto fail;
        PyObject *ts = timestamp(s[0]);
        PyObject *n_rec = ts ? PyLong_FromUnicodeObject(s[6], 10) : NULL;
        PyObject *n_part = n_rec ? PyLong_FromUnicodeObject(s[7], 10) : NULL;
        PyObject *record = n_part ? new_instance(g_record) : NULL;
        int bad = record == NULL;
        if (!bad) {
            PyObject *fields[15] = {
                token, ts, s[1], s[2], last, table, columns, mod_tuple, s[4], s[5], n_rec,
                n_part, s[8], system, Py_False,
            };
            for (int f = 0; f < 15 && !bad; f++)
                bad = set_slot(g_record_slots[f], record, fields[f]) < 0;
        }
        Py_XDECREF(ts);
        Py_XDECREF(n_rec);
        Py_XDECREF(n_part);
        Py_DECREF(mod_tuple);
        if (bad) {
            Py_XDECREF(record);
            goto fail;
        }
        PyList_SET_ITEM(out, i, record);
        measures[i] = g_record_bytes + PyBytes_GET_SIZE(mods) + g_entry_bytes * entries;
    }
    Py_CLEAR(plan);
    if (sizes != Py_None) {
        PyObject *added = PyDict_New();
        if (added == NULL) goto fail;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *key = PyLong_FromVoidPtr(PyList_GET_ITEM(out, i));
            PyObject *size = PyLong_FromSsize_t(measures[i]);
            int r = key && size ? PyDict_SetItem(added, key, size) : -1;
            Py_XDECREF(key);
            Py_XDECREF(size);
            if (r < 0) {
                Py_DECREF(added);
                goto fail;
            }
        }
        int r = PyDict_Update(sizes, added);
        Py_DECREF(added);
        if (r < 0) goto fail;
    }
    PyMem_Free(measures);
    return out;
decline:
    Py_XDECREF(plan);
    PyMem_Free(measures);
    Py_DECREF(out);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(plan);
    PyMem_Free(measures);
    Py_DECREF(out);
    return NULL;
}

/* --- non-finite floats ------------------------------------------------------------------ */

static PyObject *g_no_float;   /* a tuple of the types that hold no float (exact types) */
static PyObject *g_other;      /* asked of any other value: a float not finite inside it? */
static PyObject *g_default;    /* the JSON writer's default, for what json_default leaves */
static PyObject *g_ser_timestamp, *g_ser_decimal, *g_ser_text;  /* Timestamp, Decimal, _text */
static PyObject *g_float_text;    /* orjson.dumps: a finite float's text, as orjson writes it */
static PyObject *g_attrs_marker;  /* "__attrs_attrs__": what marks an attrs class */

static int decimal_check(void);

static PyObject *configure_walk(PyObject *self, PyObject *args) {
    PyObject *no_float, *other, *dflt, *timestamp, *decimal, *text_slot, *float_text;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!OOO!OUO", &PyTuple_Type, &no_float, &other, &dflt,
                          &PyType_Type, &timestamp, &decimal, &text_slot, &float_text))
        return NULL;
    if (g_attrs_marker == NULL
            && (g_attrs_marker = PyUnicode_InternFromString("__attrs_attrs__")) == NULL)
        return NULL;
    PyObject *descr = PyDict_GetItemWithError(((PyTypeObject *)timestamp)->tp_dict, text_slot);
    if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "not a slot of the class");
        return NULL;
    }
    keep(&g_no_float, no_float);
    keep(&g_other, other);
    keep(&g_default, dflt);
    keep(&g_ser_timestamp, timestamp);
    keep(&g_ser_decimal, decimal);
    keep(&g_ser_text, descr);
    keep(&g_float_text, float_text);
    if (decimal_check() < 0) return NULL;
    Py_RETURN_NONE;
}

/* orjson's default for the JSON writer: a Timestamp's RFC 3339 text when it has it cached
 * (decoders set it from the wire), a Decimal's positional text, else what the Python default
 * says. */
static PyObject *json_default(PyObject *self, PyObject *value) {
    (void)self;
    if (g_default == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "cdcflow._speedups: configure_walk() first");
        return NULL;
    }
    PyObject *kind = (PyObject *)Py_TYPE(value);
    if (kind == g_ser_decimal) {
        /* positional notation, as Spanner writes NUMERIC: format(d, "f"). str(d) is the
         * same text unless it has an exponent (1E-9, 1.5E+3), and a quarter of the cost */
        PyObject *text = PyObject_Str(value);
        if (text == NULL) return NULL;
        Py_ssize_t n = PyUnicode_GET_LENGTH(text);
        if (PyUnicode_FindChar(text, 'E', 0, n, 1) == -1
                && PyUnicode_FindChar(text, 'e', 0, n, 1) == -1)
            return text;
        Py_DECREF(text);
        static PyObject *positional = NULL;
        if (positional == NULL && (positional = PyUnicode_InternFromString("f")) == NULL)
            return NULL;
        return PyObject_Format(value, positional);
    }
    if (kind == g_ser_timestamp) {
        PyObject *text = Py_TYPE(g_ser_text)->tp_descr_get(g_ser_text, value, kind);
        if (text == NULL) {
            PyErr_Clear(); /* not set yet: the Python default computes it */
        } else if (PyUnicode_CheckExact(text)) {
            return text;
        } else {
            Py_DECREF(text);
        }
    }
    return PyObject_CallOneArg(g_default, value);
}

/* A value that holds no float and no other value: a str, int, None or bool. */
#define PLAIN_LEAF(kind, value) ((kind) == &PyUnicode_Type || (kind) == &PyLong_Type \
                                 || (value) == Py_None || (kind) == &PyBool_Type)

/* 1 if a float that is not finite is in value, 0 if not, -1 on an error. The loops judge
 * plain leaves and floats themselves, without a call each (most values of a row are). */
static int non_finite_in(PyObject *value, int depth) {
    PyTypeObject *kind = Py_TYPE(value);
    if (kind == &PyFloat_Type) return !isfinite(PyFloat_AS_DOUBLE(value));
    if (PLAIN_LEAF(kind, value)) return 0;
    if (depth < 64) {
        if (kind == &PyDict_Type) {
            Py_ssize_t pos = 0;
            PyObject *key, *item;
            while (PyDict_Next(value, &pos, &key, &item)) {
                PyTypeObject *item_kind = Py_TYPE(item);
                if (PLAIN_LEAF(item_kind, item)) continue;
                if (item_kind == &PyFloat_Type) {
                    if (!isfinite(PyFloat_AS_DOUBLE(item))) return 1;
                    continue;
                }
                /* the item may only be borrowed while the dict is not changed: nothing
                   here runs Python code before the next item, except for `other` */
                Py_INCREF(item);
                int found = non_finite_in(item, depth + 1);
                Py_DECREF(item);
                if (found) return found;
            }
            return 0;
        }
        if (kind == &PyList_Type || kind == &PyTuple_Type) {
            for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(value); i++) {
                PyObject *item = PySequence_Fast_GET_ITEM(value, i);
                PyTypeObject *item_kind = Py_TYPE(item);
                if (PLAIN_LEAF(item_kind, item)) continue;
                if (item_kind == &PyFloat_Type) {
                    if (!isfinite(PyFloat_AS_DOUBLE(item))) return 1;
                    continue;
                }
                Py_INCREF(item);
                int found = non_finite_in(item, depth + 1);
                Py_DECREF(item);
                if (found) return found;
            }
            return 0;
        }
    }
    Py_ssize_t n = PyTuple_GET_SIZE(g_no_float);
    for (Py_ssize_t i = 0; i < n; i++)
        if ((PyObject *)kind == PyTuple_GET_ITEM(g_no_float, i)) return 0;
    PyObject *answer = PyObject_CallOneArg(g_other, value);
    if (answer == NULL) return -1;
    int found = PyObject_IsTrue(answer);
    Py_DECREF(answer);
    return found;
}

static PyObject *non_finite(PyObject *self, PyObject *value) {
    (void)self;
    if (g_other == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "cdcflow._speedups: configure_walk() first");
        return NULL;
    }
    int found = non_finite_in(value, 0);
    if (found < 0) return NULL;
    return PyBool_FromLong(found);
}

/* --- a JSONL line ----------------------------------------------------------------------- */

/* json_line(element): cdcflow.serialize.dumps_line's line, written here in one pass: what
 * orjson writes with the writer's default, and no walk after it for floats that are not
 * finite. It writes exact dicts (str keys), lists, tuples, strs (and str subclasses, as
 * orjson does), ints within 64 bits, finite floats (orjson's own text), True, False, None,
 * Timestamps and Decimals (json_default's text), and what the Python default makes of
 * dates, datetimes, times, bytes, sets and attrs instances. It declines (None) anything
 * else: a float that is not finite, a larger int, another key, another type, a string
 * with a lone surrogate, deep nesting; the caller then takes the Python path, so the
 * line is the same whichever writes it. */

typedef struct {
    char *data;
    size_t len, cap;
    char inline_buf[1024];
} Line;

/* the slow path of line_room: a larger buffer */
static int line_grow(Line *b, size_t more) {
    size_t cap = b->cap * 2;
    while (cap < b->len + more) cap *= 2;
    char *data;
    if (b->data == b->inline_buf) {
        data = PyMem_Malloc(cap);
        if (data != NULL) memcpy(data, b->inline_buf, b->len);
    } else {
        data = PyMem_Realloc(b->data, cap);
    }
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = data;
    b->cap = cap;
    return 0;
}

static inline int line_room(Line *b, size_t more) {
    return b->len + more <= b->cap ? 0 : line_grow(b, more);
}

static inline int line_put(Line *b, const char *s, size_t n) {
    if (line_room(b, n) < 0) return -1;
    memcpy(b->data + b->len, s, n);
    b->len += n;
    return 0;
}

/* the writers return 1 when written, LEAVE (0) to decline, -1 on an error (set) */
#define LEAVE 0

static const char HEX[] = "0123456789abcdef";

/* How orjson escapes an ASCII character: 0 none, else the letter after the backslash
 * ('u' for \u00xx). */
static const char ESCAPE[128] = {
    'u', 'u', 'u', 'u', 'u', 'u', 'u', 'u', 'b', 't', 'n', 'u', 'f', 'r', 'u', 'u',
    'u', 'u', 'u', 'u', 'u', 'u', 'u', 'u', 'u', 'u', 'u', 'u', 'u', 'u', 'u', 'u',
    0, 0, '"', ['\\'] = '\\',
};

static inline size_t escape_ascii(char *o, unsigned char c) {
    char e = ESCAPE[c];
    if (e == 0) {
        o[0] = (char)c;
        return 1;
    }
    o[0] = '\\';
    if (e != 'u') {
        o[1] = e;
        return 2;
    }
    memcpy(o + 1, "u00", 3);
    o[4] = HEX[c >> 4];
    o[5] = HEX[c & 15];
    return 6;
}

/* the bytes write_str writes for s's characters (quotes aside) */
static size_t str_size(PyObject *s) {
    Py_ssize_t n = PyUnicode_GET_LENGTH(s);
    int kind = PyUnicode_KIND(s);
    const void *data = PyUnicode_DATA(s);
    size_t size = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_UCS4 cp = PyUnicode_READ(kind, data, i);
        size += cp < 0x80 ? (ESCAPE[cp] == 0 ? 1 : ESCAPE[cp] == 'u' ? 6 : 2)
              : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
    }
    return size;
}

/* Whether none of eight ASCII bytes is a control character, '"' or '\\' (the bit tricks
 * that find a byte below a bound, or a zero byte after an XOR: exact for "any"). */
static inline int plain8(uint64_t x) {
    const uint64_t ones = 0x0101010101010101ULL, high = 0x8080808080808080ULL;
    uint64_t control = (x - ones * 0x20) & ~x & high;
    uint64_t quote = x ^ (ones * '"');
    uint64_t backslash = x ^ (ones * '\\');
    quote = (quote - ones) & ~quote & high;
    backslash = (backslash - ones) & ~backslash & high;
    return (control | quote | backslash) == 0;
}

static int write_str(Line *b, PyObject *s) {
#if PY_VERSION_HEX < 0x030C0000
    if (PyUnicode_READY(s) < 0) return -1;
#endif
    Py_ssize_t n = PyUnicode_GET_LENGTH(s);
    /* at most 6 bytes out per character (an escape), 4 for any other; a long string's
     * exact size is counted first */
    if (line_room(b, n <= 4096 ? (size_t)n * 6 + 2 : str_size(s) + 2) < 0) return -1;
    char *o = b->data + b->len;
    *o++ = '"';
    if (PyUnicode_IS_ASCII(s)) {
        const unsigned char *p = (const unsigned char *)PyUnicode_DATA(s);
        const unsigned char *end = p + n;
        while (p < end) {
            /* eight characters at a time while none needs an escape */
            uint64_t word;
            if (end - p >= 8 && (memcpy(&word, p, 8), plain8(word))) {
                memcpy(o, p, 8);
                o += 8;
                p += 8;
            } else {
                o += escape_ascii(o, *p++);
            }
        }
    } else {
        int kind = PyUnicode_KIND(s);
        const void *data = PyUnicode_DATA(s);
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_UCS4 cp = PyUnicode_READ(kind, data, i);
            if (cp < 0x80) {
                o += escape_ascii(o, (unsigned char)cp);
            } else if (cp < 0x800) {
                *o++ = (char)(0xC0 | (cp >> 6));
                *o++ = (char)(0x80 | (cp & 0x3F));
            } else if (cp < 0x10000) {
                if (cp >= 0xD800 && cp <= 0xDFFF) return LEAVE;  /* orjson refuses it */
                *o++ = (char)(0xE0 | (cp >> 12));
                *o++ = (char)(0x80 | ((cp >> 6) & 0x3F));
                *o++ = (char)(0x80 | (cp & 0x3F));
            } else {
                *o++ = (char)(0xF0 | (cp >> 18));
                *o++ = (char)(0x80 | ((cp >> 12) & 0x3F));
                *o++ = (char)(0x80 | ((cp >> 6) & 0x3F));
                *o++ = (char)(0x80 | (cp & 0x3F));
            }
        }
    }
    *o++ = '"';
    b->len = (size_t)(o - b->data);
    return 1;
}

/* an unsigned integer's decimal digits, written backwards from end; returns the start */
static char *digits(char *end, unsigned long long u) {
    do {
        *--end = (char)('0' + u % 10);
        u /= 10;
    } while (u != 0);
    return end;
}

static int write_int(Line *b, PyObject *value) {
    char text[24];
    char *end = text + sizeof text, *start;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow == 0) {
        if (v == -1 && PyErr_Occurred()) return -1;
        /* the magnitude as unsigned: -(2**63) has no signed one */
        unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
        start = digits(end, u);
        if (v < 0) *--start = '-';
    } else {
        if (overflow < 0) return LEAVE;  /* below -(2**63): orjson refuses it */
        unsigned long long u = PyLong_AsUnsignedLongLong(value);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();  /* 2**64 or more */
            return LEAVE;
        }
        start = digits(end, u);
    }
    return line_put(b, start, (size_t)(end - start)) < 0 ? -1 : 1;
}

/* A Decimal's positional text (json_default's: format(d, "f")), read from the object
 * itself, for a Decimal with an exponent of 0 or less (what NUMERIC values are): no
 * context lookup, no string made. The layout is CPython's _decimal object (the same from
 * 3.3 on: the hash, then libmpdec's mpd_t, base 10**19 limbs on 64-bit builds);
 * decimal_check compares this text with format(d, "f") on sample values when the module
 * is configured, and anything else is left to json_default. */
typedef struct {
    uint8_t flags;
    Py_ssize_t exp, digits, len, alloc;
    uint64_t *data;
} MpdLayout;

typedef struct {
    PyObject_HEAD
    Py_hash_t hash;
    MpdLayout dec;
} DecimalLayout;

#define MPD_NEG 1
#define MPD_SPECIAL 14  /* infinity, NaN, sNaN */
#define MPD_LIMB_DIGITS 19
static int g_decimal_fast;  /* the layout checked out (decimal_check) */

/* 1 written (quoted, as the default's text is), LEAVE for a positive exponent, a special
 * value or anything that does not look like the layout */
static int write_decimal(Line *b, PyObject *value) {
    const MpdLayout *d = &((const DecimalLayout *)value)->dec;
    Py_ssize_t exp = d->exp, ndigits = d->digits, len = d->len;
    Py_ssize_t whole = ndigits + exp;  /* digits before the point; <= 0: "0.", zeros */
    if ((d->flags & MPD_SPECIAL) || exp > 0 || whole < -((Py_ssize_t)1 << 24) || len < 1
            || ndigits < 1
            || ndigits > len * MPD_LIMB_DIGITS || ndigits <= (len - 1) * MPD_LIMB_DIGITS
            || ndigits > (Py_ssize_t)1 << 24)
        return LEAVE;
    size_t zeros = whole < 0 ? (size_t)-whole : 0;
    if (line_room(b, (size_t)ndigits + zeros + 6) < 0) return -1;
    char *o = b->data + b->len;
    *o++ = '"';
    if (d->flags & MPD_NEG) *o++ = '-';
    if (whole <= 0) {
        *o++ = '0';
        *o++ = '.';
        memset(o, '0', zeros);
        o += zeros;
    }
    /* the coefficient's digits, most significant limb first; the top one unpadded */
    Py_ssize_t top = ndigits - (len - 1) * MPD_LIMB_DIGITS;
    char *start = o;
    for (Py_ssize_t i = len - 1; i >= 0; i--) {
        Py_ssize_t width = i == len - 1 ? top : MPD_LIMB_DIGITS;
        uint64_t limb = d->data[i];
        for (Py_ssize_t k = width - 1; k >= 0; k--) {
            o[k] = (char)('0' + limb % 10);
            limb /= 10;
        }
        if (limb != 0) return LEAVE;  /* more digits than mpd_t says: not the layout */
        o += width;
    }
    if (whole > 0 && exp < 0) {  /* the point inside the digits */
        memmove(start + whole + 1, start + whole, (size_t)-exp);
        start[whole] = '.';
        o++;
    }
    *o++ = '"';
    b->len = (size_t)(o - b->data);
    return 1;
}

static void line_free(Line *b);

/* g_decimal_fast: whether write_decimal gives json_default's text (quoted) for sample
 * values and declines those with a positive exponent; 0, or -1 on an error (set) */
static int decimal_check(void) {
    static const char *samples[] = {
        "0", "-0", "1", "-1.5", "123.456", "0.000001", "-0.0000012345", "1.00", "0.10",
        "9999999999999999999", "10000000000000000000", "-12345678901234567890.123456789",
        "0.1234567890123456789012345678901234567890", "0E-10", "1E-7", "-0.00", "5E-6",
        "99999999999999999999999999999999999999.999999999", "123456789E-20", "-7E-45",
        "1E+3", "0E+2", "-1.5E+3",
    };
    g_decimal_fast = 0;
    PyTypeObject *kind = (PyTypeObject *)g_ser_decimal;
    if (sizeof(void *) != 8 || !PyType_Check(g_ser_decimal)
            || kind->tp_basicsize != (Py_ssize_t)(sizeof(DecimalLayout) + 4 * sizeof(uint64_t)))
        return 0;
    for (size_t i = 0; i < sizeof samples / sizeof samples[0]; i++) {
        PyObject *value = PyObject_CallFunction(g_ser_decimal, "s", samples[i]);
        if (value == NULL) return -1;
        PyObject *text = Py_TYPE(value) == kind ? json_default(NULL, value) : NULL;
        if (text == NULL) {
            Py_DECREF(value);
            return PyErr_Occurred() ? -1 : 0;
        }
        Line b;
        b.data = b.inline_buf;
        b.len = 0;
        b.cap = sizeof b.inline_buf;
        int done = write_decimal(&b, value);
        Py_ssize_t n;
        const char *want = PyUnicode_AsUTF8AndSize(text, &n);
        int same = want != NULL && (strstr(samples[i], "E+") != NULL
            ? done == LEAVE
            : done == 1 && b.len == (size_t)n + 2 && memcmp(b.data + 1, want, (size_t)n) == 0);
        line_free(&b);
        Py_DECREF(text);
        Py_DECREF(value);
        if (want == NULL) return -1;
        if (!same) return 0;
    }
    g_decimal_fast = 1;
    return 0;
}

static PyObject *decimal_digits(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(g_decimal_fast);
}

static int write_value(Line *b, PyObject *value, int depth);

/* what the default makes of value, written; the default's error declines */
static int write_defaulted(Line *b, PyObject *value, int depth) {
    PyObject *made = json_default(NULL, value);
    if (made == NULL) {
        PyErr_Clear();  /* the Python path raises it again, with its own words */
        return LEAVE;
    }
    int done = write_value(b, made, depth + 1);
    Py_DECREF(made);
    return done;
}

static int is_attrs(PyTypeObject *kind) {
    PyObject *found = _PyType_Lookup(kind, g_attrs_marker);  /* borrowed, no error set */
    return found != NULL;
}

static int write_value(Line *b, PyObject *value, int depth) {
    PyTypeObject *kind = Py_TYPE(value);
    if (PyUnicode_Check(value)) return write_str(b, value);
    if (value == Py_None) return line_put(b, "null", 4) < 0 ? -1 : 1;
    if (value == Py_True) return line_put(b, "true", 4) < 0 ? -1 : 1;
    if (value == Py_False) return line_put(b, "false", 5) < 0 ? -1 : 1;
    if (kind == &PyLong_Type) return write_int(b, value);
    if (depth >= 128) return LEAVE;  /* the Python path says what it makes of it */
    if ((PyObject *)kind == g_ser_decimal && g_decimal_fast) {
        int done = write_decimal(b, value);
        if (done != LEAVE) return done;
    }
    if ((PyObject *)kind == g_ser_timestamp || (PyObject *)kind == g_ser_decimal)
        return write_defaulted(b, value, depth);
    if (kind == &PyDict_Type) {
        if (line_put(b, "{", 1) < 0) return -1;
        Py_ssize_t pos = 0;
        PyObject *key, *item;
        int first = 1;
        while (PyDict_Next(value, &pos, &key, &item)) {
            if (!PyUnicode_CheckExact(key)) return LEAVE;
            if (!first && line_put(b, ",", 1) < 0) return -1;
            first = 0;
            int done = write_str(b, key);
            if (done <= 0) return done;
            if (line_put(b, ":", 1) < 0) return -1;
            /* the default may run Python code: the item is held over it */
            Py_INCREF(item);
            done = write_value(b, item, depth + 1);
            Py_DECREF(item);
            if (done <= 0) return done;
        }
        return line_put(b, "}", 1) < 0 ? -1 : 1;
    }
    if (kind == &PyList_Type || kind == &PyTuple_Type) {
        if (line_put(b, "[", 1) < 0) return -1;
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(value); i++) {
            if (i > 0 && line_put(b, ",", 1) < 0) return -1;
            PyObject *item = PySequence_Fast_GET_ITEM(value, i);
            Py_INCREF(item);
            int done = write_value(b, item, depth + 1);
            Py_DECREF(item);
            if (done <= 0) return done;
        }
        return line_put(b, "]", 1) < 0 ? -1 : 1;
    }
    if (kind == &PyFloat_Type) {
        if (!isfinite(PyFloat_AS_DOUBLE(value))) return LEAVE;
        PyObject *text = PyObject_CallOneArg(g_float_text, value);
        if (text == NULL) return -1;
        int done = PyBytes_Check(text)
            ? (line_put(b, PyBytes_AS_STRING(text), (size_t)PyBytes_GET_SIZE(text)) < 0 ? -1 : 1)
            : LEAVE;
        Py_DECREF(text);
        return done;
    }
    if (PyDateTime_Check(value) || PyDate_Check(value) || PyTime_Check(value)
            || kind == &PyBytes_Type || kind == &PyByteArray_Type || kind == &PySet_Type
            || kind == &PyFrozenSet_Type || is_attrs(kind))
        return write_defaulted(b, value, depth);
    return LEAVE;
}

/* element's line into a new Line; 1, LEAVE or -1 as the writers; the caller frees it */
static int line_of(Line *b, PyObject *element) {
    b->data = b->inline_buf;
    b->len = 0;
    b->cap = sizeof b->inline_buf;
    if (g_default == NULL || g_float_text == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "cdcflow._speedups: configure_walk() first");
        return -1;
    }
    int done = write_value(b, element, 0);
    if (done > 0 && line_put(b, "\n", 1) < 0) return -1;
    return done;
}

static void line_free(Line *b) {
    if (b->data != b->inline_buf) PyMem_Free(b->data);
}

static PyObject *json_line(PyObject *self, PyObject *element) {
    (void)self;
    Line b;
    int done = line_of(&b, element);
    PyObject *out = done > 0 ? PyBytes_FromStringAndSize(b.data, (Py_ssize_t)b.len)
                  : done == 0 ? Py_NewRef(Py_None) : NULL;
    line_free(&b);
    return out;
}

/* --- a bus error's one line ------------------------------------------------------------ */

/* SIGBUS: a memory-mapped file failed under the process (its disk full or read-only, the
 * file truncated or made unwritable: the SQLite store's -shm index, say). The process
 * cannot go on from it (the faulting access would run again), so the handler writes the
 * line the command ends with, then exits with 1: what it wrote is the one line a command
 * ends with, instead of "Bus error" from the shell. Only what is async-signal-safe runs
 * here: the line is made in advance, and a JSON line's time is written by hand. */

static char g_bus_before[2048], g_bus_after[2048];
static size_t g_bus_before_len, g_bus_after_len;
static int g_bus_timed;

static void put_digits(char *at, long value, int width) {
    for (int i = width - 1; i >= 0; i--) {
        at[i] = (char)('0' + value % 10);
        value /= 10;
    }
}

/* "YYYY-MM-DDTHH:MM:SS.mmmZ" (24 characters) of the time now, as the log lines date it */
static void utc_stamp(char *out) {
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    long long secs = (long long)now.tv_sec;
    long long days = secs / 86400, rest = secs % 86400;
    /* days since 1970-01-01 to a civil date (Howard Hinnant's days_from_civil, inverted) */
    long long z = days + 719468;
    long long era = (z >= 0 ? z : z - 146096) / 146097;
    long long doe = z - era * 146097;
    long long yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    long long y = yoe + era * 400, doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    long long mp = (5 * doy + 2) / 153, d = doy - (153 * mp + 2) / 5 + 1;
    long long m = mp < 10 ? mp + 3 : mp - 9;
    y += m <= 2;
    memcpy(out, "0000-00-00T00:00:00.000Z", 24);
    put_digits(out, (long)y, 4);
    put_digits(out + 5, (long)m, 2);
    put_digits(out + 8, (long)d, 2);
    put_digits(out + 11, (long)(rest / 3600), 2);
    put_digits(out + 14, (long)(rest % 3600 / 60), 2);
    put_digits(out + 17, (long)(rest % 60), 2);
    put_digits(out + 20, (long)(now.tv_nsec / 1000000), 3);
}

static void write_all(const char *data, size_t n) {
    while (n > 0) {
        ssize_t done = write(2, data, n);
        if (done <= 0) return;
        data += done;
        n -= (size_t)done;
    }
}

static void on_bus_error(int signal_number) {
    (void)signal_number;
    write_all(g_bus_before, g_bus_before_len);
    if (g_bus_timed) {
        char stamp[24];
        utc_stamp(stamp);
        write_all(stamp, sizeof stamp);
        write_all(g_bus_after, g_bus_after_len);
    }
    _exit(1);
}

/* exit_on_bus_error(before, after=None): on SIGBUS, write before (then the time and after,
 * when after is given) to stderr and exit with 1 */
static PyObject *exit_on_bus_error(PyObject *self, PyObject *args) {
    (void)self;
    const char *before, *after = NULL;
    Py_ssize_t before_len, after_len = 0;
    if (!PyArg_ParseTuple(args, "y#|z#", &before, &before_len, &after, &after_len))
        return NULL;
    if ((size_t)before_len > sizeof g_bus_before || (size_t)after_len > sizeof g_bus_after) {
        PyErr_SetString(PyExc_ValueError, "the bus error's line is too long");
        return NULL;
    }
    memcpy(g_bus_before, before, (size_t)before_len);
    g_bus_before_len = (size_t)before_len;
    if (after != NULL) memcpy(g_bus_after, after, (size_t)after_len);
    g_bus_after_len = (size_t)after_len;
    g_bus_timed = after != NULL;
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_handler = on_bus_error;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGBUS, &action, NULL) != 0) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure_walk", configure_walk, METH_VARARGS,
     "configure_walk(no_float_types, other, default, Timestamp, Decimal, text_slot, float_text): "
     "the types non_finite skips, what it asks of any value that is not a float, dict, list or "
     "tuple; what json_default calls for anything but a Timestamp or a Decimal; a finite "
     "float's JSON text (bytes)"},
    {"exit_on_bus_error", exit_on_bus_error, METH_VARARGS,
     "exit_on_bus_error(before, after=None): on SIGBUS write before (then the time and "
     "after, when after is given) to stderr and exit with 1"},
    {"json_line", json_line, METH_O,
     "json_line(element) -> the JSONL line dumps_line writes (bytes), or None to decline"},
    {"decimal_digits", decimal_digits, METH_NOARGS,
     "decimal_digits() -> whether json_line writes Decimals from their digits (the layout "
     "checked out when configure_walk ran)"},
    {"json_default", json_default, METH_O,
     "json_default(value): orjson's default for the JSON writer (Timestamp, Decimal fast)"},
    {"non_finite", non_finite, METH_O,
     "non_finite(value) -> whether a float that is not finite is in value"},
    {"configure", configure, METH_VARARGS,
     "configure(loads, parse_timestamp, numeric, json, Decimal, JsonString, Mod, mod_slots, "
     "DataChangeRecord, record_slots, Timestamp, timestamp_slots, record_bytes, entry_bytes)"},
    {"decode_values", decode_values, METH_VARARGS,
     "values with each non-NULL value converted by its column's converter (a new dict)"},
    {"decode", decode, METH_VARARGS,
     "decode(token, strings, bools, lists, planner, sizes) -> list of records, or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_speedups", "cdcflow's hot loops in C (see _speedups.c).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__speedups(void) {
    PyDateTime_IMPORT;
    if (PyDateTimeAPI == NULL) return NULL;
    g_no_args = PyTuple_New(0);
    if (g_no_args == NULL) return NULL;
    return PyModule_Create(&module);
}
