/* tl_util.h - the helpers every part of tiny_llama's implementation uses:
   error messages, checked size arithmetic, little-endian bytes, opening
   regular files only, the clock.

   Part of tiny_llama.h, which includes it: include tiny_llama.h, not this file. */
#ifndef TL_UTIL_H
#define TL_UTIL_H

/* Monotonic clock in seconds. */
double tl_time_s(void);

#endif /* TL_UTIL_H */

/* ============================================================================
   Implementation (where tiny_llama.h is included with TINY_LLAMA_IMPLEMENTATION) */

#if defined(TINY_LLAMA_IMPLEMENTED) && !defined(TL_UTIL_IMPLEMENTED)
#define TL_UTIL_IMPLEMENTED

/* ----------------------------------------------------------------------------
   Utilities: errors, checked arithmetic, byte access, time */

static int tl__fail(char *err, size_t errlen, const char *fmt, ...)
{
    va_list ap;
    if (err && errlen > 0) {
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return -1;
}

/* a * b, clearing *ok on overflow */
static size_t tl__mul(size_t a, size_t b, int *ok)
{
    if (a != 0 && b > (size_t)-1 / a) {
        *ok = 0;
        return 0;
    }
    return a * b;
}

static size_t tl__add(size_t a, size_t b, int *ok)
{
    if (b > (size_t)-1 - a) {
        *ok = 0;
        return 0;
    }
    return a + b;
}

/* Header fields are little-endian; so are the weights, read in place. */
static unsigned int tl__u32(const unsigned char *p)
{
    return (unsigned int)p[0] | (unsigned int)p[1] << 8 |
           (unsigned int)p[2] << 16 | (unsigned int)p[3] << 24;
}

static int tl__i32(const unsigned char *p)
{
    unsigned int u = tl__u32(p);
    int v;
    memcpy(&v, &u, sizeof v);
    return v;
}

static float tl__f32(const unsigned char *p)
{
    unsigned int u = tl__u32(p);
    float v;
    memcpy(&v, &u, sizeof v);
    return v;
}

static void tl__put_u32(unsigned char *p, unsigned int v)
{
    p[0] = (unsigned char)(v & 0xff);
    p[1] = (unsigned char)(v >> 8 & 0xff);
    p[2] = (unsigned char)(v >> 16 & 0xff);
    p[3] = (unsigned char)(v >> 24 & 0xff);
}

static void tl__put_i32(unsigned char *p, int v)
{
    unsigned int u;
    memcpy(&u, &v, sizeof u);
    tl__put_u32(p, u);
}

double tl_time_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ----------------------------------------------------------------------------
   Files: only regular files are read */

/* What a file that is not a regular file is, for error messages. */
static const char *tl__file_kind(mode_t mode)
{
    if (S_ISDIR(mode)) return "a directory";
    if (S_ISFIFO(mode)) return "a named pipe";
    if (S_ISCHR(mode)) return "a character device";
    if (S_ISBLK(mode)) return "a block device";
#ifdef S_ISSOCK
    if (S_ISSOCK(mode)) return "a socket";
#endif
    return "not a regular file";
}

/* Opens a file for reading; only regular files are accepted. The open does
   not block (a named pipe without a writer would wait forever), and blocking
   reads are restored once the file is known to be regular. Returns the file
   descriptor with its status in *st, or -1 with a message in err. */
static int tl__open_regular(const char *path, const char *what, struct stat *st,
                            char *err, size_t errlen)
{
    int fd = open(path, O_RDONLY | O_NONBLOCK), flags;
    if (fd < 0)
        return tl__fail(err, errlen, "cannot open %s %s: %s", what, path, strerror(errno));
    if (fstat(fd, st) != 0) {
        int e = errno;
        close(fd);
        return tl__fail(err, errlen, "cannot stat %s %s: %s", what, path, strerror(e));
    }
    if (!S_ISREG(st->st_mode)) {
        close(fd);
        return tl__fail(err, errlen, "%s %s is %s, not a regular file", what, path,
                        tl__file_kind(st->st_mode));
    }
    flags = fcntl(fd, F_GETFL);
    if (flags == -1 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) == -1) {
        int e = errno;
        close(fd);
        return tl__fail(err, errlen, "cannot read %s %s: %s", what, path, strerror(e));
    }
    return fd;
}

#endif /* TL_UTIL implementation */
