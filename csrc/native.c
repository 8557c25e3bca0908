/*
 * kvconnect._native: the data-path loops that must not hold the GIL.
 *
 * sendv/recvv move a whole frame (many buffers) through a socket in one call: the GIL is released
 * for the entire scatter/gather loop, so several stream threads overlap their I/O instead of taking
 * turns on the interpreter for every syscall. copy_many is a batch of memcpys with the GIL released
 * once (large pieces with non-temporal stores).
 *
 * The module also holds the master's key table (keytable.c), which keeps the GIL.
 *
 * Timeouts are stall timeouts: the call fails with TimeoutError when no byte moves for `timeout`
 * seconds. Sockets may be blocking or non-blocking; EAGAIN waits in poll().
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <sched.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#include "keytable.h"

#define MAX_IOV 1024

enum io_result { IO_OK = 0, IO_ERRNO = 1, IO_TIMEOUT = 2, IO_EOF = 3 };

typedef struct {
    Py_buffer *views;
    struct iovec *iov;
    Py_ssize_t count;
} iov_set;

static void iov_set_free(iov_set *set) {
    if (set->views != NULL) {
        for (Py_ssize_t i = 0; i < set->count; i++) {
            PyBuffer_Release(&set->views[i]);
        }
    }
    PyMem_Free(set->views);
    PyMem_Free(set->iov);
    set->views = NULL;
    set->iov = NULL;
    set->count = 0;
}

/* Acquire every buffer of `seq` (contiguous, writable when asked) and build the iovec array. */
static int iov_set_init(iov_set *set, PyObject *seq, int writable) {
    PyObject *fast = PySequence_Fast(seq, "buffers must be a sequence");
    if (fast == NULL) {
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    set->count = 0;
    set->views = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Py_buffer));
    set->iov = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(struct iovec));
    if (set->views == NULL || set->iov == NULL) {
        Py_DECREF(fast);
        iov_set_free(set);
        PyErr_NoMemory();
        return -1;
    }
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, i), &set->views[i], flags) < 0) {
            Py_DECREF(fast);
            iov_set_free(set);
            return -1;
        }
        set->count = i + 1;
        set->iov[i].iov_base = set->views[i].buf;
        set->iov[i].iov_len = (size_t)set->views[i].len;
    }
    Py_DECREF(fast);
    return 0;
}

static int wait_ready(int fd, short events, int timeout_ms) {
    struct pollfd pfd = {.fd = fd, .events = events, .revents = 0};
    for (;;) {
        int rc = poll(&pfd, 1, timeout_ms);
        if (rc > 0) {
            return IO_OK;
        }
        if (rc == 0) {
            return IO_TIMEOUT;
        }
        if (errno != EINTR) {
            return IO_ERRNO;
        }
    }
}

/* Move every byte of iov[0..count) through fd; runs without the GIL. */
static int vector_io(int fd, struct iovec *iov, Py_ssize_t count, int sending, int timeout_ms,
                     int *err) {
    Py_ssize_t first = 0;
    while (first < count && iov[first].iov_len == 0) {
        first++;
    }
    while (first < count) {
        struct msghdr msg;
        memset(&msg, 0, sizeof(msg));
        msg.msg_iov = &iov[first];
        msg.msg_iovlen = (size_t)((count - first) < MAX_IOV ? (count - first) : MAX_IOV);
        ssize_t done = sending ? sendmsg(fd, &msg, MSG_NOSIGNAL) : recvmsg(fd, &msg, 0);
        if (done < 0) {
            if (errno == EINTR) {
                continue;
            }
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                int rc = wait_ready(fd, sending ? POLLOUT : POLLIN, timeout_ms);
                if (rc != IO_OK) {
                    *err = errno;
                    return rc;
                }
                continue;
            }
            *err = errno;
            return IO_ERRNO;
        }
        if (done == 0 && !sending) {
            return IO_EOF;
        }
        size_t left = (size_t)done;
        while (first < count && left >= iov[first].iov_len) {
            left -= iov[first].iov_len;
            first++;
        }
        if (left > 0) {
            iov[first].iov_base = (char *)iov[first].iov_base + left;
            iov[first].iov_len -= left;
        }
        while (first < count && iov[first].iov_len == 0) {
            first++;
        }
    }
    return IO_OK;
}

static int timeout_to_ms(double timeout) {
    if (timeout < 0) {
        return -1;
    }
    double ms = timeout * 1000.0;
    return ms > (double)INT_MAX ? INT_MAX : (int)ms;
}

static PyObject *vector_call(PyObject *args, int sending) {
    int fd;
    PyObject *buffers;
    double timeout;
    if (!PyArg_ParseTuple(args, "iOd", &fd, &buffers, &timeout)) {
        return NULL;
    }
    iov_set set;
    if (iov_set_init(&set, buffers, !sending) < 0) {
        return NULL;
    }
    int err = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = vector_io(fd, set.iov, set.count, sending, timeout_to_ms(timeout), &err);
    Py_END_ALLOW_THREADS
    iov_set_free(&set);
    switch (rc) {
    case IO_OK:
        Py_RETURN_NONE;
    case IO_TIMEOUT:
        PyErr_SetString(PyExc_TimeoutError, sending ? "send stalled" : "receive stalled");
        return NULL;
    case IO_EOF:
        PyErr_SetString(PyExc_ConnectionResetError, "peer closed the connection");
        return NULL;
    default:
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
}

static PyObject *native_sendv(PyObject *self, PyObject *args) {
    (void)self;
    return vector_call(args, 1);
}

static PyObject *native_recvv(PyObject *self, PyObject *args) {
    (void)self;
    return vector_call(args, 0);
}

#if defined(__SSE2__)
#include <emmintrin.h>
#include <stdint.h>

/* Pieces at least this large are copied with non-temporal stores: a KV page written into a
 * store segment (or read into an engine's pool) is not read again by this core soon, and
 * streaming it past the caches skips reading each destination line first (a plain copy
 * reads, then writes, every destination byte). About 1.5x on this kind of machine. */
#define STREAM_BYTES ((size_t)256 << 10)

static void stream_copy(char *dst, const char *src, size_t n) {
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15; /* stores want 16-byte alignment */
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
    _mm_sfence(); /* the streamed bytes are visible before whoever learns the copy is done */
}
#endif

/* memmove, streaming large pieces that do not overlap. */
static void copy_bytes(char *dst, const char *src, size_t n) {
#if defined(__SSE2__)
    if (n >= STREAM_BYTES && (dst + n <= src || src + n <= dst)) {
        stream_copy(dst, src, n);
        return;
    }
#endif
    memmove(dst, src, n);
}

static PyObject *native_copy_many(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *dst_seq, *src_seq;
    if (!PyArg_ParseTuple(args, "OO", &dst_seq, &src_seq)) {
        return NULL;
    }
    iov_set dst, src;
    if (iov_set_init(&dst, dst_seq, 1) < 0) {
        return NULL;
    }
    if (iov_set_init(&src, src_seq, 0) < 0) {
        iov_set_free(&dst);
        return NULL;
    }
    int bad = dst.count != src.count;
    for (Py_ssize_t i = 0; !bad && i < dst.count; i++) {
        bad = dst.iov[i].iov_len != src.iov[i].iov_len;
    }
    if (bad) {
        iov_set_free(&dst);
        iov_set_free(&src);
        PyErr_SetString(PyExc_ValueError, "copy_many: buffer counts or lengths differ");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < dst.count; i++) {
        copy_bytes(dst.iov[i].iov_base, src.iov[i].iov_base, dst.iov[i].iov_len);
    }
    Py_END_ALLOW_THREADS
    iov_set_free(&dst);
    iov_set_free(&src);
    Py_RETURN_NONE;
}


static double monotonic_now(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}

/* 1: fd is readable (or hung up, or in error: the caller's read reports which); 0: not by
 * `timeout` seconds; -1: poll failed (errno). For the first `spin` seconds it only asks (poll
 * with no wait), yielding the CPU between asks, so an answer that comes soon finds this thread
 * running: a sleeping thread's wake-up costs tens of microseconds on a VM's idle vCPU. */
static int spin_then_wait(int fd, double spin, double timeout) {
    struct pollfd pfd = {.fd = fd, .events = POLLIN, .revents = 0};
    double start = monotonic_now();
    double spin_end = start + (spin < timeout ? spin : timeout);
    for (;;) {
        int rc = poll(&pfd, 1, 0);
        if (rc > 0) {
            return 1;
        }
        if (rc < 0 && errno != EINTR) {
            return -1;
        }
        if (monotonic_now() >= spin_end) {
            break;
        }
        sched_yield();
    }
    for (;;) {
        double left = start + timeout - monotonic_now();
        if (left <= 0) {
            return 0;
        }
        /* rounded up: poll's milliseconds must not end the wait before `timeout` */
        int ms = timeout_to_ms(left);
        int rc = poll(&pfd, 1, ms < INT_MAX ? ms + 1 : ms);
        if (rc > 0) {
            return 1;
        }
        if (rc < 0 && errno != EINTR) {
            return -1;
        }
    }
}

static PyObject *native_wait_readable(PyObject *self, PyObject *args) {
    (void)self;
    int fd;
    double spin, timeout;
    if (!PyArg_ParseTuple(args, "idd", &fd, &spin, &timeout)) {
        return NULL;
    }
    if (!(spin >= 0 && timeout >= 0)) { /* also refuses NaN */
        PyErr_SetString(PyExc_ValueError, "wait_readable: spin and timeout must be >= 0");
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = spin_then_wait(fd, spin, timeout);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyBool_FromLong(rc);
}

static PyMethodDef native_methods[] = {
    {"sendv", native_sendv, METH_VARARGS,
     "sendv(fd, buffers, timeout) -> None\n\nSend every byte of every buffer; GIL released."},
    {"recvv", native_recvv, METH_VARARGS,
     "recvv(fd, buffers, timeout) -> None\n\nFill every buffer from the socket; GIL released."},
    {"copy_many", native_copy_many, METH_VARARGS,
     "copy_many(dsts, srcs) -> None\n\nmemmove each pair of equal-length buffers; GIL released "
     "once for all."},
    {"wait_readable", native_wait_readable, METH_VARARGS,
     "wait_readable(fd, spin, timeout) -> bool\n\nWhether fd became readable within timeout "
     "seconds; polls without sleeping for the first spin seconds. GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "kvconnect._native",
    .m_doc = "kvconnect's optional native data path and the master's key table.",
    .m_size = -1,
    .m_methods = native_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *module = PyModule_Create(&native_module);
    if (module != NULL && keytable_register(module) < 0) {
        Py_CLEAR(module);
    }
    return module;
}
