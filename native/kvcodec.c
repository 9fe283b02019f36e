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

static PyObject *dequantize_portable(PyObject *self, PyObject *args)
{
    return run(args, dequantize_portable_impl);
}

static PyMethodDef methods[] = {
    {"dequantize", dequantize, METH_VARARGS,
     "dequantize(out, codes, mins, steps, key, bits, dtype, tokens, channels, group): one "
     "part of a quantized block into `out` (dtype 1 fp16, 2 bf16, 3 fp32). mins and steps "
     "are float16; sizes must match the geometry (ValueError). Runs outside the GIL."},
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
