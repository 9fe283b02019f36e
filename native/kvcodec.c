/* ucm._kvcodec: the decoding loop of the int8/int4 KV codecs (ucm/codecs/quant.py), one part of
 * a block a call, outside the GIL. The loop compiled for AVX2 and F16C (kvcodec_avx2.c) is
 * chosen at import when the CPU has both; IMPL names the one in use. Built by setup.py as an
 * optional extension: without it ucm.codecs decodes with numpy. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define KV_IMPL dequantize_portable_impl
#include "kvcodec_impl.h"

typedef int (*impl_t)(char *, const uint8_t *, const uint16_t *, const uint16_t *, int, int, int,
                      size_t, size_t, size_t, float *, float *, float *);
#if defined(__x86_64__) || defined(__i386__)
int dequantize_avx2(char *, const uint8_t *, const uint16_t *, const uint16_t *, int, int, int,
                    size_t, size_t, size_t, float *, float *, float *);
#endif
static impl_t best_impl = dequantize_portable_impl;
static const char *best_name = "portable";

static PyObject *run(PyObject *args, impl_t impl)
{
    Py_buffer out, codes, mins, steps;
    int key, bits, dtype;
    Py_ssize_t tokens, channels, group;
    if (!PyArg_ParseTuple(args, "w*y*y*y*iiinnn", &out, &codes, &mins, &steps, &key, &bits,
                          &dtype, &tokens, &channels, &group))
        return NULL;
    PyObject *result = NULL;
    float *scratch = NULL;
    size_t itemsize = dtype == 3 ? 4 : 2;
    if (tokens < 1 || channels < 1 || group < 1 || (bits != 8 && bits != 4) || dtype < 1 ||
        dtype > 3 || (key ? tokens % group : channels % group) ||
        (bits == 4 && channels % 2) || tokens > (1 << 24) || channels > (1 << 24)) {
        PyErr_SetString(PyExc_ValueError, "dequantize: bad geometry");
        goto done;
    }
    size_t n = (size_t)tokens * (size_t)channels;
    size_t nparams = key ? (size_t)(tokens / group) * channels : (size_t)tokens * (channels / group);
    if ((size_t)out.len != n * itemsize || (size_t)codes.len != (bits == 8 ? n : n / 2) ||
        (size_t)mins.len != 2 * nparams || (size_t)steps.len != 2 * nparams) {
        PyErr_SetString(PyExc_ValueError, "dequantize: buffer sizes do not match the geometry");
        goto done;
    }
    scratch = PyMem_Malloc(((size_t)channels + 2 * nparams) * sizeof(float));
    if (scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    impl((char *)out.buf, (const uint8_t *)codes.buf, (const uint16_t *)mins.buf,
         (const uint16_t *)steps.buf, key, bits, dtype, (size_t)tokens, (size_t)channels,
         (size_t)group, scratch, scratch + channels, scratch + channels + nparams);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_Free(scratch);
    PyBuffer_Release(&out);
    PyBuffer_Release(&codes);
    PyBuffer_Release(&mins);
    PyBuffer_Release(&steps);
    return result;
}

static PyObject *dequantize(PyObject *self, PyObject *args) { return run(args, best_impl); }

/* A whole block: `plan` holds per part six int64 (kind 0 raw / 1 k / 2 v, tokens, channels,
 * group, offset in out, offset in payload), as ucm/codecs/quant.py's `_plan` makes them; every
 * range is checked against the buffers before the loop runs. */
static PyObject *dequantize_block(PyObject *self, PyObject *args)
{
    Py_buffer out, payload, plan;
    int bits, dtype;
    if (!PyArg_ParseTuple(args, "w*y*y*ii", &out, &payload, &plan, &bits, &dtype))
        return NULL;
    PyObject *result = NULL;
    float *scratch = NULL;
    const int64_t *p = (const int64_t *)plan.buf;
    size_t nparts = (size_t)plan.len / (6 * sizeof(int64_t)), itemsize = dtype == 3 ? 4 : 2;
    size_t most = 0;
    if ((bits != 8 && bits != 4) || dtype < 1 || dtype > 3 || plan.len % (6 * 8))
        goto bad;
    for (size_t i = 0; i < nparts; i++) {
        const int64_t *q = p + 6 * i;
        int64_t kind = q[0], t = q[1], c = q[2], g = q[3], oo = q[4], po = q[5];
        if (t < 1 || c < 1 || g < 1 || t > (1 << 24) || c > (1 << 24) || oo < 0 || po < 0 ||
            kind < 0 || kind > 2)
            goto bad;
        size_t n = (size_t)t * (size_t)c;
        if (kind == 0) {
            if ((size_t)oo + (size_t)t > (size_t)out.len ||
                (size_t)po + (size_t)t > (size_t)payload.len)
                goto bad;
            continue;
        }
        if ((kind == 1 ? t % g : c % g) || (bits == 4 && c % 2))
            goto bad;
        size_t np = kind == 1 ? (size_t)(t / g) * c : (size_t)t * (c / g);
        size_t need = 4 * np + (bits == 8 ? n : n / 2);
        if ((size_t)oo + n * itemsize > (size_t)out.len || (size_t)po + need > (size_t)payload.len)
            goto bad;
        if ((size_t)c + 2 * np > most)
            most = (size_t)c + 2 * np;
    }
    scratch = PyMem_Malloc((most ? most : 1) * sizeof(float));
    if (scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 0; i < nparts; i++) {
        const int64_t *q = p + 6 * i;
        size_t t = (size_t)q[1], c = (size_t)q[2], g = (size_t)q[3];
        char *o = (char *)out.buf + q[4];
        const uint8_t *in = (const uint8_t *)payload.buf + q[5];
        if (q[0] == 0) {
            memcpy(o, in, t);
            continue;
        }
        size_t np = q[0] == 1 ? (t / g) * c : t * (c / g);
        best_impl(o, in + 4 * np, (const uint16_t *)in, (const uint16_t *)(in + 2 * np),
                  q[0] == 1, bits, dtype, t, c, g, scratch, scratch + c, scratch + c + np);
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
    goto done;
bad:
    PyErr_SetString(PyExc_ValueError, "dequantize_block: the plan does not fit the buffers");
done:
    PyMem_Free(scratch);
    PyBuffer_Release(&out);
    PyBuffer_Release(&payload);
    PyBuffer_Release(&plan);
    return result;
}

static PyObject *dequantize_portable(PyObject *self, PyObject *args)
{
    return run(args, dequantize_portable_impl);
}

static PyMethodDef methods[] = {
    {"dequantize", dequantize, METH_VARARGS,
     "dequantize(out, codes, mins, steps, key, bits, dtype, tokens, channels, group): one "
     "part of a quantized block into `out` (dtype 1 fp16, 2 bf16, 3 fp32). mins and steps "
     "are float16; sizes must match the geometry (ValueError). Runs outside the GIL."},
    {"dequantize_block", dequantize_block, METH_VARARGS,
     "dequantize_block(out, payload, plan, bits, dtype): every part of a block in one call "
     "(plan: int64 kind, tokens, channels, group, out offset, payload offset per part)."},
    {"dequantize_portable", dequantize_portable, METH_VARARGS,
     "dequantize with the loop every CPU runs."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ucm._kvcodec", "Decoding loops of the int8/int4 KV codecs.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__kvcodec(void)
{
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
        best_impl = dequantize_avx2;
        best_name = "avx2";
    }
#endif
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "IMPL", best_name) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
