/* The allocator trainyard-bwrap is linked with (deploy/local/build-bwrap.sh): memory is taken from the kernel in
 * chunks that are never given back, and handed out in order.
 *
 * Why: bwrap allocates only while it sets a sandbox up (a few hundred kilobytes at most: its arguments and, for
 * every bind, the mount table read whole), then waits for the job without allocating again. musl's allocator
 * maps and unmaps a group of pages for many of those requests (some 40 mmap and 35 munmap calls a sandbox, each
 * with page faults), a cost paid for every node of every job; handing out memory in order costs none of it.
 * Freeing or growing the newest block (how bwrap frees: its cleanup handlers run in the reverse order of the
 * allocations) reuses its memory; any other freed block stays taken until the process ends.
 *
 * bwrap runs one thread: nothing here locks.
 */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#define ALIGN 16
#define CHUNK (1u << 20)

struct header {
  size_t size; /* what the block may hold */
  size_t pad;  /* keeps what follows aligned to ALIGN */
};

static char *top;   /* where the next block begins */
static char *end;   /* the end of the current chunk */
static char *fresh; /* from here to `end` the chunk was never handed out: still zero, as mapped */
static char *last;  /* the newest block, which may be given back or grown in place */

static size_t rounded (size_t n, size_t to) { return (n + to - 1) & ~(to - 1); }

static int take_chunk (size_t need)
{
  size_t size = need > CHUNK ? rounded (need, 4096) : CHUNK;
  void *chunk = mmap (NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (chunk == MAP_FAILED)
    return -1;
  top = fresh = chunk;
  end = top + size;
  last = NULL;
  return 0;
}

static void *block (size_t n, size_t align)
{
  if (n > SIZE_MAX / 2)
    {
      errno = ENOMEM;
      return NULL;
    }
  n = rounded (n ? n : 1, ALIGN);
  for (;;)
    {
      uintptr_t start = rounded ((uintptr_t) top + sizeof (struct header), align);
      if (top != NULL && start + n <= (uintptr_t) end)
        {
          char *p = (char *) start;
          ((struct header *) p)[-1].size = n;
          top = p + n;
          if (top > fresh)
            fresh = top;
          last = p;
          return p;
        }
      if (take_chunk (n + align + sizeof (struct header)) != 0)
        {
          errno = ENOMEM;
          return NULL;
        }
    }
}

static size_t size_of (void *p) { return ((struct header *) p)[-1].size; }

void *malloc (size_t n) { return block (n, ALIGN); }

void free (void *p)
{
  if (p != NULL && p == last)
    { /* the newest block: its memory is handed out again */
      top = (char *) p - sizeof (struct header);
      last = NULL;
    }
}

void *calloc (size_t count, size_t n)
{
  if (n != 0 && count > SIZE_MAX / n)
    {
      errno = ENOMEM;
      return NULL;
    }
  char *before = fresh;
  char *p = block (count * n, ALIGN);
  if (p != NULL && p < before) /* memory handed out before may hold anything: only what was never used is zero */
    memset (p, 0, (size_t) ((before < p + count * n ? before : p + count * n) - p));
  return p;
}

void *realloc (void *p, size_t n)
{
  if (p == NULL)
    return malloc (n);
  size_t had = size_of (p);
  if (p == last && (size_t) (end - (char *) p) >= rounded (n ? n : 1, ALIGN))
    { /* the newest block grows or shrinks where it is */
      size_t now = rounded (n ? n : 1, ALIGN);
      ((struct header *) p)[-1].size = now;
      top = (char *) p + now;
      if (top > fresh)
        fresh = top;
      return p;
    }
  if (n <= had)
    return p;
  void *moved = malloc (n);
  if (moved != NULL)
    memcpy (moved, p, had);
  return moved;
}

void *aligned_alloc (size_t align, size_t n)
{
  if (align == 0 || (align & (align - 1)) != 0)
    {
      errno = EINVAL;
      return NULL;
    }
  return block (n, align < ALIGN ? ALIGN : align);
}

int posix_memalign (void **out, size_t align, size_t n)
{
  if (align < sizeof (void *) || (align & (align - 1)) != 0)
    return EINVAL;
  void *p = block (n, align < ALIGN ? ALIGN : align);
  if (p == NULL)
    return ENOMEM;
  *out = p;
  return 0;
}

void *memalign (size_t align, size_t n) { return aligned_alloc (align, n); }

size_t malloc_usable_size (void *p) { return p == NULL ? 0 : size_of (p); }
