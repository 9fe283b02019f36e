/* ucm._hostcopy: copy a block and take its xxh3-64 in one pass over the source.
 *
 * Hashing then copying reads a block twice (xxh3 over the source, then memmove). Here each
 * 64 KiB chunk is copied with non-temporal stores and then hashed from the cache
 * (hostcopy_impl.h); on CPUs with AVX2 the loop compiled for it (hostcopy_avx2.c) is used
 * (figures: docs/performance.md, Copy and checksum in one pass).
 *
 * The digest is the one `xxhash.xxh3_64_intdigest` gives (seed 0), whichever loop runs.
 *
 * Built by setup.py as an optional extension (gcc and xxhash.h from Debian libxxhash-dev;
 * scripts/setup.sh installs them); ucm.block falls back to xxh3 then memmove without it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

#define HASH_COPY_IMPL hash_copy_portable_impl
#include "hostcopy_impl.h"

#if defined(__x86_64__) || defined(__i386__)
uint64_t hash_copy_avx2(const piece_t *pieces, Py_ssize_t count, const char *src);
#endif

typedef uint64_t (*impl_t)(const piece_t *, Py_ssize_t, const char *);
static impl_t best_impl = hash_copy_portable_impl; /* set at import: see PyInit__hostcopy */
static const char *best_name = "portable";

#define MAX_PIECES 4096 /* ucm.block.HASH_COPY_MAX_PIECES mirrors it */

static PyObject *run(PyObject *args, impl_t impl, const char *format)
{
    PyObject *dst_obj, *src_obj;
    if (!PyArg_ParseTuple(args, format, &dst_obj, &src_obj))
        return NULL;
    /* dst: one buffer, or a list or tuple of buffers (a ucm.block.Scatter's pieces) */
    int many = PyList_Check(dst_obj) || PyTuple_Check(dst_obj);
    Py_ssize_t count = many ? PySequence_Fast_GET_SIZE(dst_obj) : 1;
    if (count < 1 || count > MAX_PIECES) {
        PyErr_Format(PyExc_ValueError, "hash_copy: 1 to %d destination pieces, not %zd",
                     MAX_PIECES, count);
        return NULL;
    }
    Py_buffer *views = PyMem_Calloc((size_t)count, sizeof(Py_buffer));
    piece_t *pieces = PyMem_Calloc((size_t)count, sizeof(piece_t));
    Py_ssize_t held = 0, total = 0;
    PyObject *result = NULL;
    Py_buffer src;
    int have_src = 0;
    if (views == NULL || pieces == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < count; held++) {
        PyObject *item = many ? PySequence_Fast_GET_ITEM(dst_obj, held) : dst_obj;
        if (PyObject_GetBuffer(item, &views[held], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        pieces[held].buf = views[held].buf;
        pieces[held].len = (size_t)views[held].len;
        total += views[held].len;
    }
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    have_src = 1;
    if (total != src.len) {
        PyErr_Format(PyExc_ValueError, "hash_copy: destination is %zd bytes, source %zd",
                     total, src.len);
        goto done;
    }
    uint64_t digest;
    Py_BEGIN_ALLOW_THREADS
    digest = impl(pieces, count, (const char *)src.buf);
    Py_END_ALLOW_THREADS
    result = PyLong_FromUnsignedLongLong(digest);
done:
    if (have_src)
        PyBuffer_Release(&src);
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(pieces);
    return result;
}

static PyObject *hash_copy(PyObject *self, PyObject *args)
{
    return run(args, best_impl, "OO:hash_copy");
}

static PyObject *hash_copy_portable(PyObject *self, PyObject *args)
{
    return run(args, hash_copy_portable_impl, "OO:hash_copy_portable");
}

static PyMethodDef methods[] = {
    {"hash_copy", hash_copy, METH_VARARGS,
     "hash_copy(dst, src) -> int: copies src into dst (one writable buffer, or a list or "
     "tuple of them filled in order) and returns the xxh3-64 of src. Sizes must add up; "
     "every buffer C-contiguous. Runs outside the GIL. Uses the fastest loop this CPU runs "
     "(IMPL names it)."},
    {"hash_copy_portable", hash_copy_portable, METH_VARARGS,
     "hash_copy_portable(dst, src) -> int: hash_copy with the loop every CPU runs."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ucm._hostcopy", "Copy a block and take its xxh3-64 in one pass.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__hostcopy(void)
{
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
        best_impl = hash_copy_avx2;
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
