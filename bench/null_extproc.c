/* A null ext_proc processor in C: the floor of a compiled processor in Narwhal's place.
 *
 *   cc -O2 -o null_extproc_c bench/null_extproc.c -lnghttp2
 *   null_extproc_c SOCKET REQUEST_HEADERS_REPLY RESPONSE_HEADERS_REPLY \
 *                  REQUEST_TRAILERS_REPLY RESPONSE_TRAILERS_REPLY
 *
 * It answers each ext_proc message as bench/null_extproc.py does (the Python null
 * processor on Narwhal's transport), with no logic: the four header and trailer replies
 * are given in hex, serialized by the benchmark with Narwhal's own encoder (so the
 * destination header and envoy.lb metadata are the bytes Narwhal sends); both bodies are
 * echoed as FULL_DUPLEX_STREAMED wants them back, a compact "stream":false in the request
 * body turned into "stream":true followed by a space (same length) as Narwhal asks engines
 * for a stream. Envoy's access-log stream is read and dropped.
 *
 * Why it exists: the Python null processor showed that no Python processor on this
 * transport meets the data-path targets; this one measures what a compiled processor
 * costs, and what Envoy itself costs beside a processor that costs almost nothing, so
 * that which targets any ext_proc processor can meet is measured, not argued. HTTP/2 is
 * nghttp2's (the field's C library), the event loop plain epoll on one thread, protobuf
 * read and written by hand (only the oneof's tag and an HttpBody are read).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <nghttp2/nghttp2.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define MAX_MESSAGE (4u << 20) /* a larger gRPC message resets its stream */
#define PROCESS_PATH "/envoy.service.ext_proc.v3.ExternalProcessor/Process"

typedef struct {
    uint8_t *p;
    size_t len, cap, off; /* off: bytes already taken from the front */
} buf_t;

static void buf_add(buf_t *b, const void *data, size_t n) {
    if (b->off && b->off == b->len) b->off = b->len = 0;
    if (b->len + n > b->cap) {
        if (b->off) { /* reclaim the consumed front first */
            memmove(b->p, b->p + b->off, b->len - b->off);
            b->len -= b->off;
            b->off = 0;
        }
        if (b->len + n > b->cap) {
            size_t cap = b->cap ? b->cap : 4096;
            while (cap < b->len + n) cap *= 2;
            uint8_t *p = realloc(b->p, cap);
            if (!p) { perror("realloc"); exit(1); }
            b->p = p;
            b->cap = cap;
        }
    }
    memcpy(b->p + b->len, data, n);
    b->len += n;
}

static size_t buf_size(const buf_t *b) { return b->len - b->off; }

typedef struct {
    uint8_t *p;
    size_t n;
} blob_t;

static blob_t replies[4]; /* request headers, response headers, request/response trailers */

typedef struct {
    int32_t id;
    int process; /* an ext_proc stream (else the access log: read, never answered) */
    int half_closed;
    buf_t in, out;
} stream_t;

typedef struct {
    int fd;
    nghttp2_session *session;
    buf_t wbuf; /* bytes nghttp2 produced that the socket did not take yet */
    int want_out;
} conn_t;

static int epfd;

/* ---- protobuf, by hand ------------------------------------------------------------ */

static int read_varint(const uint8_t **p, const uint8_t *end, uint64_t *v) {
    uint64_t r = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (*p >= end) return -1;
        uint8_t c = *(*p)++;
        r |= (uint64_t)(c & 0x7f) << shift;
        if (!(c & 0x80)) { *v = r; return 0; }
    }
    return -1;
}

static size_t put_varint(uint8_t *out, uint64_t v) {
    size_t n = 0;
    while (v >= 0x80) { out[n++] = (uint8_t)(v | 0x80); v >>= 7; }
    out[n++] = (uint8_t)v;
    return n;
}

static int skip_field(const uint8_t **p, const uint8_t *end, int wire) {
    uint64_t v;
    switch (wire) {
    case 0: return read_varint(p, end, &v);
    case 1: if (end - *p < 8) return -1; *p += 8; return 0;
    case 2:
        if (read_varint(p, end, &v) || v > (uint64_t)(end - *p)) return -1;
        *p += v;
        return 0;
    case 5: if (end - *p < 4) return -1; *p += 4; return 0;
    default: return -1;
    }
}

/* The oneof's field number (2..7) and its bytes; 0 when the message has none. */
static int which(const uint8_t *p, const uint8_t *end, const uint8_t **sub, size_t *sublen) {
    int kind = 0;
    while (p < end) {
        uint64_t tag, len;
        if (read_varint(&p, end, &tag)) return -1;
        int field = (int)(tag >> 3), wire = (int)(tag & 7);
        if (field >= 2 && field <= 7 && wire == 2) {
            if (read_varint(&p, end, &len) || len > (uint64_t)(end - p)) return -1;
            kind = field;
            *sub = p;
            *sublen = len;
            p += len;
        } else if (skip_field(&p, end, wire)) {
            return -1;
        }
    }
    return kind;
}

/* HttpBody: body = 1, end_of_stream = 2. */
static int http_body(const uint8_t *p, const uint8_t *end, const uint8_t **body, size_t *n,
                     int *eos) {
    *body = p;
    *n = 0;
    *eos = 0;
    while (p < end) {
        uint64_t tag, v;
        if (read_varint(&p, end, &tag)) return -1;
        int field = (int)(tag >> 3), wire = (int)(tag & 7);
        if (field == 1 && wire == 2) {
            if (read_varint(&p, end, &v) || v > (uint64_t)(end - p)) return -1;
            *body = p;
            *n = v;
            p += v;
        } else if (field == 2 && wire == 0) {
            if (read_varint(&p, end, &v)) return -1;
            *eos = v != 0;
        } else if (skip_field(&p, end, wire)) {
            return -1;
        }
    }
    return 0;
}

/* One gRPC message holding ProcessingResponse{request_body = 3 | response_body = 4:
 * BodyResponse{response: CommonResponse{body_mutation: BodyMutation{streamed_response:
 * StreamedBodyResponse{body, end_of_stream}}}}}, the bytes upb writes. */
static void send_body(buf_t *out, int response, const uint8_t *body, size_t n, int eos) {
    uint8_t head[64];
    size_t sbr = (n ? 1 + put_varint(head, n) + n : 0) + (eos ? 2 : 0);
    size_t bm = 1 + put_varint(head, sbr) + sbr;
    size_t cr = 1 + put_varint(head, bm) + bm;
    size_t br = 1 + put_varint(head, cr) + cr;
    size_t total = 1 + put_varint(head, br) + br;
    size_t h = 0;
    head[h++] = 0;
    head[h++] = (uint8_t)(total >> 24);
    head[h++] = (uint8_t)(total >> 16);
    head[h++] = (uint8_t)(total >> 8);
    head[h++] = (uint8_t)total;
    head[h++] = response ? 0x22 : 0x1a;
    h += put_varint(head + h, br);
    head[h++] = 0x0a;
    h += put_varint(head + h, cr);
    head[h++] = 0x1a;
    h += put_varint(head + h, bm);
    head[h++] = 0x1a;
    h += put_varint(head + h, sbr);
    if (n) {
        head[h++] = 0x0a;
        h += put_varint(head + h, n);
    }
    buf_add(out, head, h);
    buf_add(out, body, n);
    if (eos) buf_add(out, "\x10\x01", 2);
}

static void send_blob(buf_t *out, const blob_t *b) {
    uint8_t head[5] = {0, (uint8_t)(b->n >> 24), (uint8_t)(b->n >> 16), (uint8_t)(b->n >> 8),
                       (uint8_t)b->n};
    buf_add(out, head, 5);
    buf_add(out, b->p, b->n);
}

/* Answer one ProcessingRequest; -1 when it cannot be decoded. */
static int answer(stream_t *st, const uint8_t *msg, size_t n) {
    const uint8_t *sub = NULL, *body;
    size_t sublen = 0, blen;
    int eos, kind = which(msg, msg + n, &sub, &sublen);
    switch (kind) {
    case 2: send_blob(&st->out, &replies[0]); return 0;
    case 3: send_blob(&st->out, &replies[1]); return 0;
    case 6: send_blob(&st->out, &replies[2]); return 0;
    case 7: send_blob(&st->out, &replies[3]); return 0;
    case 4:
    case 5:
        if (http_body(sub, sub + sublen, &body, &blen, &eos)) return -1;
        if (kind == 4) { /* the same length: no content-length to change */
            static const char from[] = "\"stream\":false", to[] = "\"stream\":true ";
            uint8_t *copy = NULL;
            const uint8_t *at = body;
            for (;;) {
                const uint8_t *hit = memmem(at, blen - (size_t)(at - body), from, 14);
                if (!hit) break;
                if (!copy) { /* the message is const: rewrite a copy */
                    copy = malloc(blen);
                    memcpy(copy, body, blen);
                }
                memcpy(copy + (hit - body), to, 14);
                at = hit + 14;
            }
            send_body(&st->out, 0, copy ? copy : body, blen, eos);
            free(copy);
        } else {
            send_body(&st->out, 1, body, blen, eos);
        }
        return 0;
    default: return kind < 0 ? -1 : 0;
    }
}

/* ---- HTTP/2 and gRPC on nghttp2 ---------------------------------------------------- */

static ssize_t read_out(nghttp2_session *s, int32_t id, uint8_t *dst, size_t len,
                        uint32_t *flags, nghttp2_data_source *src, void *user) {
    (void)src;
    (void)user;
    stream_t *st = nghttp2_session_get_stream_user_data(s, id);
    if (!st) return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
    size_t have = buf_size(&st->out);
    if (have) {
        size_t n = have < len ? have : len;
        memcpy(dst, st->out.p + st->out.off, n);
        st->out.off += n;
        return (ssize_t)n;
    }
    if (!st->half_closed) return NGHTTP2_ERR_DEFERRED;
    *flags |= NGHTTP2_DATA_FLAG_EOF | NGHTTP2_DATA_FLAG_NO_END_STREAM;
    const nghttp2_nv trailer[] = {{(uint8_t *)"grpc-status", (uint8_t *)"0", 11, 1,
                                   NGHTTP2_NV_FLAG_NONE}};
    nghttp2_submit_trailer(s, id, trailer, 1);
    return 0;
}

static int on_begin_headers(nghttp2_session *s, const nghttp2_frame *f, void *user) {
    (void)user;
    if (f->hd.type != NGHTTP2_HEADERS || f->headers.cat != NGHTTP2_HCAT_REQUEST) return 0;
    stream_t *st = calloc(1, sizeof *st);
    st->id = f->hd.stream_id;
    nghttp2_session_set_stream_user_data(s, f->hd.stream_id, st);
    return 0;
}

static int on_header(nghttp2_session *s, const nghttp2_frame *f, const uint8_t *name,
                     size_t namelen, const uint8_t *value, size_t valuelen, uint8_t flags,
                     void *user) {
    (void)flags;
    (void)user;
    if (f->hd.type != NGHTTP2_HEADERS || f->headers.cat != NGHTTP2_HCAT_REQUEST) return 0;
    stream_t *st = nghttp2_session_get_stream_user_data(s, f->hd.stream_id);
    if (st && namelen == 5 && !memcmp(name, ":path", 5) &&
        valuelen == sizeof PROCESS_PATH - 1 && !memcmp(value, PROCESS_PATH, valuelen))
        st->process = 1;
    return 0;
}

static int on_frame_recv(nghttp2_session *s, const nghttp2_frame *f, void *user) {
    (void)user;
    stream_t *st = nghttp2_session_get_stream_user_data(s, f->hd.stream_id);
    if (!st) return 0;
    if (f->hd.type == NGHTTP2_HEADERS && f->headers.cat == NGHTTP2_HCAT_REQUEST) {
        const nghttp2_nv hdrs[] = {
            {(uint8_t *)":status", (uint8_t *)"200", 7, 3, NGHTTP2_NV_FLAG_NONE},
            {(uint8_t *)"content-type", (uint8_t *)"application/grpc", 12, 16,
             NGHTTP2_NV_FLAG_NONE}};
        nghttp2_data_provider dp = {.source = {.ptr = st}, .read_callback = read_out};
        nghttp2_submit_response(s, st->id, hdrs, 2, &dp);
    }
    if ((f->hd.type == NGHTTP2_HEADERS || f->hd.type == NGHTTP2_DATA) &&
        (f->hd.flags & NGHTTP2_FLAG_END_STREAM)) {
        st->half_closed = 1;
        if (!st->process) buf_add(&st->out, "\0\0\0\0\0", 5); /* StreamAccessLogsResponse */
        nghttp2_session_resume_data(s, st->id);
    }
    return 0;
}

static int on_data(nghttp2_session *s, uint8_t flags, int32_t id, const uint8_t *data,
                   size_t len, void *user) {
    (void)flags;
    (void)user;
    stream_t *st = nghttp2_session_get_stream_user_data(s, id);
    if (!st || !st->process) return 0;
    buf_add(&st->in, data, len);
    size_t before = buf_size(&st->out);
    while (buf_size(&st->in) >= 5) {
        const uint8_t *p = st->in.p + st->in.off;
        uint32_t n = (uint32_t)p[1] << 24 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 8 | p[4];
        if (p[0] != 0 || n > MAX_MESSAGE) {
            nghttp2_submit_rst_stream(s, NGHTTP2_FLAG_NONE, id, NGHTTP2_PROTOCOL_ERROR);
            return 0;
        }
        if (buf_size(&st->in) < 5 + (size_t)n) break;
        if (answer(st, p + 5, n)) {
            nghttp2_submit_rst_stream(s, NGHTTP2_FLAG_NONE, id, NGHTTP2_PROTOCOL_ERROR);
            return 0;
        }
        st->in.off += 5 + n;
    }
    if (buf_size(&st->out) != before) nghttp2_session_resume_data(s, id);
    return 0;
}

static int on_stream_close(nghttp2_session *s, int32_t id, uint32_t code, void *user) {
    (void)code;
    (void)user;
    stream_t *st = nghttp2_session_get_stream_user_data(s, id);
    if (st) {
        free(st->in.p);
        free(st->out.p);
        free(st);
    }
    return 0;
}

static void conn_close(conn_t *c) {
    epoll_ctl(epfd, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    nghttp2_session_del(c->session);
    free(c->wbuf.p);
    free(c);
}

/* Write what nghttp2 has to send; 0 ok, -1 closed. */
static int flush(conn_t *c) {
    for (;;) {
        while (buf_size(&c->wbuf)) {
            ssize_t w = write(c->fd, c->wbuf.p + c->wbuf.off, buf_size(&c->wbuf));
            if (w < 0 && errno == EINTR) continue;
            if (w < 0 && errno == EAGAIN) {
                if (!c->want_out) {
                    struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT, .data.ptr = c};
                    epoll_ctl(epfd, EPOLL_CTL_MOD, c->fd, &ev);
                    c->want_out = 1;
                }
                return 0;
            }
            if (w < 0) return -1;
            c->wbuf.off += (size_t)w;
        }
        const uint8_t *data;
        ssize_t n = nghttp2_session_mem_send(c->session, &data);
        if (n < 0) {
            fprintf(stderr, "null_extproc_c: closing a connection: %s\n",
                    nghttp2_strerror((int)n));
            return -1;
        }
        if (n == 0) break;
        ssize_t w = write(c->fd, data, (size_t)n);
        if (w < 0 && errno != EAGAIN && errno != EINTR) return -1;
        if (w < 0) w = 0;
        if (w < n) buf_add(&c->wbuf, data + w, (size_t)(n - w));
    }
    if (c->want_out) {
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
        epoll_ctl(epfd, EPOLL_CTL_MOD, c->fd, &ev);
        c->want_out = 0;
    }
    if (!nghttp2_session_want_read(c->session) && !nghttp2_session_want_write(c->session))
        return -1;
    return 0;
}

static nghttp2_session_callbacks *callbacks;
static nghttp2_option *options;

static void accept_all(int lfd) {
    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) return;
        conn_t *c = calloc(1, sizeof *c);
        c->fd = fd;
        nghttp2_session_server_new2(&c->session, callbacks, c, options);
        /* Narwhal's settings: no push, 16,384 streams, 8 MiB windows. */
        const nghttp2_settings_entry iv[] = {{NGHTTP2_SETTINGS_ENABLE_PUSH, 0},
                                             {NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS, 16384},
                                             {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, 8 << 20}};
        nghttp2_submit_settings(c->session, NGHTTP2_FLAG_NONE, iv, 3);
        nghttp2_session_set_local_window_size(c->session, NGHTTP2_FLAG_NONE, 0, 8 << 20);
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
        epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev);
        if (flush(c)) conn_close(c);
    }
}

static int hexblob(const char *hex, blob_t *out) {
    size_t n = strlen(hex);
    if (n % 2) return -1;
    out->n = n / 2;
    out->p = malloc(out->n ? out->n : 1);
    for (size_t i = 0; i < out->n; i++) {
        unsigned v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1) return -1;
        out->p[i] = (uint8_t)v;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s SOCKET REQ_HEADERS RESP_HEADERS REQ_TRAILERS RESP_TRAILERS"
                        " (replies in hex)\n", argv[0]);
        return 2;
    }
    for (int i = 0; i < 4; i++)
        if (hexblob(argv[2 + i], &replies[i])) {
            fprintf(stderr, "bad hex in argument %d\n", 2 + i);
            return 2;
        }
    signal(SIGPIPE, SIG_IGN);
    nghttp2_session_callbacks_new(&callbacks);
    nghttp2_session_callbacks_set_on_begin_headers_callback(callbacks, on_begin_headers);
    nghttp2_session_callbacks_set_on_header_callback(callbacks, on_header);
    nghttp2_session_callbacks_set_on_frame_recv_callback(callbacks, on_frame_recv);
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(callbacks, on_data);
    nghttp2_session_callbacks_set_on_stream_close_callback(callbacks, on_stream_close);
    /* Envoy resets each ext_proc stream when its request is done: nghttp2's guard against
     * rapid resets (1,000, then 33 a second) would end the connection, and every request
     * on it, within a second of load. The peer is the proxy this processor serves. */
    nghttp2_option_new(&options);
    nghttp2_option_set_stream_reset_rate_limit(options, UINT64_MAX, UINT64_MAX);

    int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(argv[1]) >= sizeof addr.sun_path) {
        fprintf(stderr, "socket path too long\n");
        return 2;
    }
    strcpy(addr.sun_path, argv[1]);
    unlink(argv[1]);
    if (bind(lfd, (struct sockaddr *)&addr, sizeof addr) || listen(lfd, 1024)) {
        perror("listen");
        return 1;
    }
    epfd = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event lev = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(epfd, EPOLL_CTL_ADD, lfd, &lev);
    uint8_t rbuf[65536];
    struct epoll_event evs[64];
    for (;;) {
        int n = epoll_wait(epfd, evs, 64, -1);
        for (int i = 0; i < n; i++) {
            conn_t *c = evs[i].data.ptr;
            if (!c) {
                accept_all(lfd);
                continue;
            }
            int dead = 0;
            if (evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
                ssize_t r = read(c->fd, rbuf, sizeof rbuf);
                if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) dead = 1;
                else if (r > 0) {
                    ssize_t rv = nghttp2_session_mem_recv(c->session, rbuf, (size_t)r);
                    if (rv < 0) {
                        fprintf(stderr, "null_extproc_c: closing a connection: %s\n",
                                nghttp2_strerror((int)rv));
                        dead = 1;
                    }
                }
            }
            if (dead || flush(c)) conn_close(c);
        }
    }
}
