/* replay.c - runs a libFuzzer target's entry point over files, without libFuzzer: each
 * argument is a file or a directory of files, each file one input. `make coverage` links
 * it with every tests/fuzz/fuzz_NAME.c under gcc --coverage and replays the seed corpus
 * and the inputs the bounded fuzz run of the test suite kept. */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int replay_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    unsigned char *buf = NULL;
    long n;
    if (!f) return 0;
    if (fseek(f, 0, SEEK_END) != 0 || (n = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0 ||
        (buf = (unsigned char *)malloc((size_t)n + 1)) == NULL || fread(buf, 1, (size_t)n, f) != (size_t)n) {
        fclose(f);
        free(buf);
        return 0;
    }
    fclose(f);
    LLVMFuzzerTestOneInput(buf, (size_t)n);
    free(buf);
    return 1;
}

int main(int argc, char **argv)
{
    int i, n = 0;
    for (i = 1; i < argc; i++) {
        struct stat st;
        if (stat(argv[i], &st) != 0) continue;
        if (S_ISDIR(st.st_mode)) {
            DIR *d = opendir(argv[i]);
            struct dirent *e;
            char path[4096];
            while (d && (e = readdir(d)) != NULL) {
                if (e->d_name[0] == '.') continue;
                snprintf(path, sizeof path, "%s/%s", argv[i], e->d_name);
                n += replay_file(path);
            }
            if (d) closedir(d);
        } else {
            n += replay_file(argv[i]);
        }
    }
    printf("replayed %d inputs\n", n);
    return 0;
}
