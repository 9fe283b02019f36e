/* ucm._kvcodec: the coding loops of the int8/int4 KV codecs (ucm/codecs/quant.py), a block a
 * call, outside the GIL. The loops compiled for AVX2 and F16C (kvcodec_avx2.c) are chosen at
 * import when the CPU has both; IMPL names the ones in use. Built by setup.py as an optional
 * extension: without it ucm.codecs codes with numpy. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define KV_SUFFIX portable
#include "kvcodec_impl.h"

typedef void (*decode_t)(const kv_part_t *, size_t, kv_out_t *, const uint8_t *, size_t, int, int,
                         float *, size_t *, void *);
typedef int (*encode_t)(const kv_part_t *, size_t, uint8_t *, const char *, int, int, float *,
                        size_t *);
#if defined(__x86_64__) || defined(__i386__)
void kv_decode_block_avx2(const kv_part_t *, size_t, kv_out_t *, const uint8_t *, size_t, int,
                          int, float *, size_t *, void *);
int kv_encode_block_avx2(const kv_part_t *, size_t, uint8_t *, const char *, int, int, float *,
                         size_t *);
#endif
static decode_t best_decode = kv_decode_block_portable;
static encode_t best_encode = kv_encode_block_portable;
static const char *best_name = "portable";

#define MAX_DIM (1 << 24)
#define MAX_PIECES 4096     /* a Scatter's pieces (ucm.block.HASH_COPY_MAX_PIECES mirrors it) */
#define STREAM_MIN (1 << 18) /* blocks this large are written with non-temporal stores */

/* The plan (9 int64 a part: kind 0 raw / 1 k / 2 v, tokens, channels, group, offset in the raw
 * block, offset in the payload, c-major, ti, ci) checked against the buffers; the scratch each
 * side needs (floats, size_t, and bytes for a row that crosses a destination piece). Returns the parts (PyMem) or NULL with ValueError set. */
static kv_part_t *check_plan(const Py_buffer *plan, size_t raw_len, size_t payload_len, int bits,
                             int dtype, size_t *nparts, size_t *floats, size_t *sizes,
                             size_t *row_bytes)
{
    if ((bits != 8 && bits != 4) || dtype < 1 || dtype > 3 || plan->len % (9 * 8) ||
        plan->len == 0)
        goto bad;
    size_t n = (size_t)plan->len / (9 * 8), itemsize = dtype == 3 ? 4 : 2;
    const int64_t *q = (const int64_t *)plan->buf;
    kv_part_t *parts = PyMem_Calloc(n, sizeof(kv_part_t));
    if (parts == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    *floats = *sizes = *row_bytes = 1;
    for (size_t i = 0; i < n; i++, q += 9) {
        int64_t kind = q[0], t = q[1], c = q[2], g = q[3], oo = q[4], po = q[5], cm = q[6],
                ti = q[7], ci = q[8];
        if (kind < 0 || kind > 2 || t < 1 || c < 1 || g < 1 || t > MAX_DIM || c > MAX_DIM ||
            oo < 0 || po < 0 || (uint64_t)oo > raw_len || (uint64_t)po > payload_len ||
            cm < 0 || cm > 1 || ti < 1 || ci < 1 || t % ti || c % ci)
            goto bad_parts;
        kv_part_t *p = parts + i;
        *p = (kv_part_t){(size_t)kind, (size_t)t, (size_t)c, (size_t)g, (size_t)oo, (size_t)po,
                         (size_t)cm, (size_t)ti, (size_t)ci, (size_t)t};
        if (kind == 0) {
            if (c != 1 || cm || ti != 1 || ci != 1 || (size_t)t > raw_len - (size_t)oo ||
                (size_t)t > payload_len - (size_t)po)
                goto bad_parts;
            continue;
        }
        if (kind == 1 ? t % g : c % g)
            goto bad_parts;
        size_t count = (size_t)t * (size_t)c, ng = kv_groups(p);
        size_t need = 4 + 2 * ng + (bits == 8 ? count : (count + 1) / 2); /* int4: 2 a byte */
        if (count > raw_len / itemsize || count * itemsize > raw_len - (size_t)oo ||
            need > payload_len - (size_t)po)
            goto bad_parts;
        p->payload_len = need;
        if (count * itemsize > *row_bytes)
            *row_bytes = count * itemsize; /* the longest row kv_emit may convert aside */
        size_t f = 3 * count + (size_t)c + 2 * ng + 16; /* kv_decode_part's scratch */
        if (f > *floats)
            *floats = f;
        if ((size_t)t + (size_t)c > *sizes)
            *sizes = (size_t)t + (size_t)c;
    }
    *nparts = n;
    return parts;
bad_parts:
    PyMem_Free(parts);
bad:
    PyErr_SetString(PyExc_ValueError, "the plan does not fit the buffers");
    return NULL;
}

/* dequantize_block(out, payload, plan, bits, dtype): `out` one writable buffer or a list or
 * tuple of them (a Scatter's pieces, filled in order). Returns the payload's xxh3-64, taken in
 * the same pass, or None when built without xxhash.h. */
static PyObject *decode(PyObject *args, decode_t impl)
{
    PyObject *out_obj;
    Py_buffer payload, plan;
    int bits, dtype;
    if (!PyArg_ParseTuple(args, "Oy*y*ii", &out_obj, &payload, &plan, &bits, &dtype))
        return NULL;
    int many = PyList_Check(out_obj) || PyTuple_Check(out_obj);
    Py_ssize_t count = many ? PySequence_Fast_GET_SIZE(out_obj) : 1, held = 0;
    PyObject *result = NULL;
    size_t nparts = 0, floats = 0, sizes = 0, row_bytes = 0, total = 0;
    float *fs = NULL;
    size_t *zs = NULL;
    char *tmp = NULL;
    kv_part_t *parts = NULL;
    Py_buffer *views = NULL;
    kv_piece_t *pieces = NULL;
    if (count < 1 || count > MAX_PIECES) {
        PyErr_Format(PyExc_ValueError, "dequantize_block: 1 to %d destination pieces, not %zd",
                     MAX_PIECES, count);
        goto done;
    }
    views = PyMem_Calloc((size_t)count, sizeof(Py_buffer));
    pieces = PyMem_Calloc((size_t)count, sizeof(kv_piece_t));
    if (views == NULL || pieces == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < count; held++) {
        PyObject *item = many ? PySequence_Fast_GET_ITEM(out_obj, held) : out_obj;
        if (PyObject_GetBuffer(item, &views[held], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        pieces[held] = (kv_piece_t){views[held].buf, (size_t)views[held].len};
        total += (size_t)views[held].len;
    }
    parts = check_plan(&plan, total, (size_t)payload.len, bits, dtype, &nparts, &floats, &sizes,
                       &row_bytes);
    if (parts == NULL)
        goto done;
    fs = PyMem_Malloc(floats * sizeof(float));
    zs = PyMem_Malloc(sizes * sizeof(size_t));
    tmp = PyMem_Malloc(row_bytes);
    if (fs == NULL || zs == NULL || tmp == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    kv_out_t out = {pieces, (size_t)count, 0, 0, tmp, total >= STREAM_MIN};
#if defined(KV_HAVE_XXH)
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    Py_BEGIN_ALLOW_THREADS
    impl(parts, nparts, &out, (const uint8_t *)payload.buf, (size_t)payload.len, bits, dtype, fs,
         zs, &state);
    Py_END_ALLOW_THREADS
    result = PyLong_FromUnsignedLongLong(XXH3_64bits_digest(&state));
#else
    Py_BEGIN_ALLOW_THREADS
    impl(parts, nparts, &out, (const uint8_t *)payload.buf, (size_t)payload.len, bits, dtype, fs,
         zs, NULL);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
#endif
done:
    PyMem_Free(parts);
    PyMem_Free(fs);
    PyMem_Free(zs);
    PyMem_Free(tmp);
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(pieces);
    PyBuffer_Release(&payload);
    PyBuffer_Release(&plan);
    return result;
}

static PyObject *encode(PyObject *args, encode_t impl)
{
    Py_buffer out, raw, plan;
    int bits, dtype;
    if (!PyArg_ParseTuple(args, "w*y*y*ii", &out, &raw, &plan, &bits, &dtype))
        return NULL;
    PyObject *result = NULL;
    size_t nparts = 0, floats = 0, sizes = 0;
    float *fs = NULL;
    size_t *zs = NULL;
    int status = 0;
    size_t row_bytes = 0;
    kv_part_t *parts = check_plan(&plan, (size_t)raw.len, (size_t)out.len, bits, dtype, &nparts,
                                  &floats, &sizes, &row_bytes);
    if (parts == NULL)
        goto done;
    fs = PyMem_Malloc(floats * sizeof(float));
    zs = PyMem_Malloc(sizes * sizeof(size_t));
    if (fs == NULL || zs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    status = impl(parts, nparts, (uint8_t *)out.buf, (const char *)raw.buf, bits, dtype, fs, zs);
    Py_END_ALLOW_THREADS
    result = PyLong_FromLong(status);
done:
    PyMem_Free(parts);
    PyMem_Free(fs);
    PyMem_Free(zs);
    PyBuffer_Release(&out);
    PyBuffer_Release(&raw);
    PyBuffer_Release(&plan);
    return result;
}

static PyObject *dequantize_block(PyObject *self, PyObject *args)
{
    return decode(args, best_decode);
}

static PyObject *dequantize_block_portable(PyObject *self, PyObject *args)
{
    return decode(args, kv_decode_block_portable);
}

static PyObject *quantize_block(PyObject *self, PyObject *args)
{
    return encode(args, best_encode);
}

static PyObject *quantize_block_portable(PyObject *self, PyObject *args)
{
    return encode(args, kv_encode_block_portable);
}

static PyMethodDef methods[] = {
    {"dequantize_block", dequantize_block, METH_VARARGS,
     "dequantize_block(out, payload, plan, bits, dtype) -> xxh3-64 of payload (None without "
     "xxhash.h), taken in the same pass: every part of a block into `out`, one writable buffer "
     "or a list or tuple of them filled in order (dtype 1 fp16, 2 bf16, 3 fp32; plan: int64 "
     "kind, tokens, channels, group, out offset, payload offset, c-major, ti, ci per part, "
     "checked against the buffers: ValueError). Runs outside the GIL."},
    {"dequantize_block_portable", dequantize_block_portable, METH_VARARGS,
     "dequantize_block with the loops every CPU runs."},
    {"quantize_block", quantize_block, METH_VARARGS,
     "quantize_block(payload, raw, plan, bits, dtype) -> 0, or 1 (a non-finite value) or 2 "
     "(a range beyond float16): the payload of a block (its exact length). Outside the GIL."},
    {"quantize_block_portable", quantize_block_portable, METH_VARARGS,
     "quantize_block with the loops every CPU runs."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ucm._kvcodec", "Coding loops of the int8/int4 KV codecs.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__kvcodec(void)
{
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
        best_decode = kv_decode_block_avx2;
        best_encode = kv_encode_block_avx2;
        best_name = "avx2";
    }
#endif
    PyObject *m = PyModule_Create(&module);
#if defined(KV_HAVE_XXH)
    int hashes = 1;
#else
    int hashes = 0;
#endif
    if (m != NULL && (PyModule_AddStringConstant(m, "IMPL", best_name) < 0 ||
                      PyModule_AddIntConstant(m, "HASHES", hashes) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
