/* The framing of frames without tensors in C: an experiment of bench/bench_framing_c.py, which
   compiles this file and puts its three functions in place of tensorpipe_backend's Python ones
   (wire.FrameReader.take_reply and read_frame, connection.Connection.write) in both processes.
   Frames are those of tensorpipe_backend/wire.py: a 28-byte header "!4sB3xQIII" (magic "TPB1",
   kind, 3 pad bytes, message id, payload length, tensor count, descriptor bytes), then the
   payload. Anything but a whole frame without tensors is left to the Python code. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#define HEADER_SIZE 28
#define KIND_REPLY 2
#define KIND_ERROR 3
#define LAST_KIND 7

static uint64_t get_be(const unsigned char *p, int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes; i++) v = (v << 8) | p[i];
    return v;
}

static void put_be(unsigned char *p, uint64_t v, int bytes) {
    for (int i = bytes - 1; i >= 0; i--, v >>= 8) p[i] = (unsigned char)v;
}

/* The payload length of the frame without tensors at p, or -1 if it is not one (bad magic or
   kind, tensors announced). */
static Py_ssize_t small_payload(const unsigned char *p) {
    unsigned kind = p[4];
    if (memcmp(p, "TPB1", 4) != 0 || kind == 0 || kind > LAST_KIND || get_be(p + 20, 8) != 0) return -1;
    return (Py_ssize_t)get_be(p + 16, 4);
}

/* take_reply(fd, msg_id, buffer) -> (kind, payload) | True | False: wire.FrameReader.take_reply
   for a socket with nothing buffered: True while the reply has not wholly arrived, False when
   another frame (or one with tensors, or one longer than buffer) comes first. */
static PyObject *take_reply(PyObject *self, PyObject *args) {
    (void)self;
    int fd, err = 0;
    unsigned long long msg_id;
    Py_buffer buf;
    if (!PyArg_ParseTuple(args, "iKw*", &fd, &msg_id, &buf)) return NULL;
    unsigned char *data = buf.buf;
    PyObject *result = NULL;
    ssize_t got;
    Py_BEGIN_ALLOW_THREADS
    got = recv(fd, data, (size_t)buf.len, MSG_PEEK | MSG_DONTWAIT);
    err = errno;
    Py_END_ALLOW_THREADS
    if (got < 0 && (err == EAGAIN || err == EWOULDBLOCK)) {
        result = Py_NewRef(Py_True);
    } else if (got < 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
    } else if (got == 0) {
        PyErr_SetString(PyExc_EOFError, "connection closed");
    } else if (got < HEADER_SIZE) {
        result = Py_NewRef(Py_True);
    } else {
        Py_ssize_t payload = small_payload(data), length = HEADER_SIZE + payload;
        unsigned kind = data[4];
        if (payload < 0 || get_be(data + 8, 8) != msg_id || (kind != KIND_REPLY && kind != KIND_ERROR) ||
            length > buf.len) {
            result = Py_NewRef(Py_False);
        } else if (got < length) {
            result = Py_NewRef(Py_True);
        } else {
            Py_BEGIN_ALLOW_THREADS
            got = recv(fd, data, (size_t)length, MSG_WAITALL);
            err = errno;
            Py_END_ALLOW_THREADS
            if (got < 0) {
                errno = err;
                PyErr_SetFromErrno(PyExc_OSError);
            } else if (got != length) {
                PyErr_SetString(PyExc_EOFError, "connection closed within a frame");
            } else {
                result = Py_BuildValue("(iy#)", (int)kind, (const char *)data + HEADER_SIZE, payload);
            }
        }
    }
    PyBuffer_Release(&buf);
    return result;
}

/* next_small(buffer, start, end) -> (kind, msg_id, payload, new_start) | None: the whole frame
   without tensors at buffer[start:end], or None (the Python reader takes it). */
static PyObject *next_small(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer buf;
    Py_ssize_t start, end;
    if (!PyArg_ParseTuple(args, "y*nn", &buf, &start, &end)) return NULL;
    PyObject *result = Py_None;
    if (start >= 0 && end <= buf.len && end - start >= HEADER_SIZE) {
        const unsigned char *p = (const unsigned char *)buf.buf + start;
        Py_ssize_t payload = small_payload(p);
        if (payload >= 0 && end - start >= HEADER_SIZE + payload) {
            result = Py_BuildValue("(iKy#n)", (int)p[4], (unsigned long long)get_be(p + 8, 8),
                                   (const char *)p + HEADER_SIZE, payload, start + HEADER_SIZE + payload);
        }
    }
    PyBuffer_Release(&buf);
    return result == Py_None ? Py_NewRef(Py_None) : result;
}

/* send_small(fd, kind, msg_id, payload): a frame without tensors, header and payload in one
   sendmsg (repeated until all is out) on a blocking socket. */
static PyObject *send_small(PyObject *self, PyObject *args) {
    (void)self;
    int fd, kind, err = 0;
    unsigned long long msg_id;
    Py_buffer payload;
    if (!PyArg_ParseTuple(args, "iiKy*", &fd, &kind, &msg_id, &payload)) return NULL;
    unsigned char header[HEADER_SIZE] = {'T', 'P', 'B', '1', (unsigned char)kind};
    put_be(header + 8, msg_id, 8);
    put_be(header + 16, (uint64_t)payload.len, 4);
    struct iovec iov[2] = {{header, HEADER_SIZE}, {payload.buf, (size_t)payload.len}};
    struct msghdr msg = {.msg_iov = iov, .msg_iovlen = 2};
    size_t left = HEADER_SIZE + (size_t)payload.len;
    Py_BEGIN_ALLOW_THREADS
    while (left > 0) {
        ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (sent < 0 && errno == EINTR) continue;
        if (sent < 0) {
            err = errno;
            break;
        }
        left -= (size_t)sent;
        for (int i = 0; i < 2; i++) {
            size_t taken = (size_t)sent < iov[i].iov_len ? (size_t)sent : iov[i].iov_len;
            iov[i].iov_base = (char *)iov[i].iov_base + taken;
            iov[i].iov_len -= taken;
            sent -= (ssize_t)taken;
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&payload);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"take_reply", take_reply, METH_VARARGS, "Take the whole reply frame msg_id from a socket, if next."},
    {"next_small", next_small, METH_VARARGS, "Decode a whole buffered frame without tensors."},
    {"send_small", send_small, METH_VARARGS, "Send a frame without tensors in one system call."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "tpb_framing_c", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit_tpb_framing_c(void) { return PyModule_Create(&module); }
