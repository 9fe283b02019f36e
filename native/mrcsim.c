/* ucm._mrcsim: the live miss-ratio curve's front (the sample test, the hot keys) and its
 * miniature caches (ucm/kernel/_mrc.py) for the `lru` and `shadow` policies, reference for
 * reference what the Python code does with the same references (_mrc._PyFront over
 * _mrc.PolicyMiniatures: LRUPolicy, ShadowLRUPolicy with its weight miniatures,
 * _MiniatureShadow), at a small fraction of its CPU: the curve's two-point accuracy needs
 * miniatures of about 1,000 blocks, which in Python cost a quarter of the kernel's CPU
 * (docs/autotune.md). tests/kernel/test_mrc_native.py runs both and compares every count.
 *
 * A key is known by a 64-bit hash of all its bytes (a collision, ~2**-64 a pair, would merge
 * two keys), its sample place (its first four bytes, big-endian) and, for `shadow`'s sample of
 * its weight miniatures, its CRC-32 (zlib's). The eight weight miniatures of a `shadow`
 * miniature share one table and one node a key (they see the same references; only their
 * victims differ), so a reference costs one lookup for all eight. A key keeps the size it was
 * first admitted with while it stays anywhere in them (the tier's blocks do not change size).
 * Built by setup.py as an optional extension: without it the curve runs the Python code. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SPACE ((uint64_t)1 << 32)
#define NWEIGHTS 8 /* ShadowLRUPolicy.WEIGHTS: 1, 2, 4, ..., 128 */
#define SAMPLE_BLOCKS 256.0
#define GHOST_FACTOR 4
#define DECAY 0.5
#define ACTIVE 2 /* _MiniatureShadow.ACTIVE and CYCLE */
#define CYCLE 8
#define HOT_WINDOW 4096 /* _mrc.HOT_WINDOW, HOT_SHARE, MAX_HOT */
#define HOT_SHARE 0.01
#define MAX_HOT 16
#define FRESH 0
#define MAIN 1
#define GHOST 2
#define NONE 3
#define NIL (-1)

static const double WEIGHT[NWEIGHTS] = {1, 2, 4, 8, 16, 32, 64, 128};

/* -- a hash table of 64-bit keys to node indexes ------------------------------------------- */

/* Linear probing over slots of 8 bytes: the key's top 32 bits (its home comes from them, so
 * a deletion's backward shift reads no node) and the node's index; a match is confirmed
 * against the node's own key (each node type begins with it), found through `base`. */
typedef struct {
    uint32_t fp;
    int32_t idx; /* NIL where empty */
} slot_t;

typedef struct {
    slot_t *slots;
    uint64_t mask;
    int64_t count;
    char **base; /* the nodes' memory (a pool's, which may move) */
    size_t stride;
    uint64_t salt; /* each table its own: a key's probe starts at other offsets in others */
} table_t;

static inline uint32_t fp_of(uint64_t key) { return (uint32_t)(key >> 32); }

static inline uint64_t home_of(const table_t *t, uint32_t fp)
{
    return (((uint64_t)fp * 0x9E3779B97F4A7C15ull) >> 24) ^ t->salt;
}

static inline uint64_t key_at(const table_t *t, int32_t idx)
{
    uint64_t key;
    memcpy(&key, *t->base + (size_t)idx * t->stride, sizeof(key));
    return key;
}

static uint64_t tables_made;

static int table_init(table_t *t, uint64_t size, char **base, size_t stride)
{
    t->salt = (++tables_made * 0xD6E8FEB86659FD93ull) >> 20;
    t->slots = PyMem_Malloc(sizeof(slot_t) * size);
    if (!t->slots)
        return -1;
    for (uint64_t i = 0; i < size; i++)
        t->slots[i].idx = NIL;
    t->mask = size - 1;
    t->count = 0;
    t->base = base;
    t->stride = stride;
    return 0;
}

static inline int32_t table_find(const table_t *t, uint64_t key)
{
    uint32_t fp = fp_of(key);
    for (uint64_t i = home_of(t, fp) & t->mask;; i = (i + 1) & t->mask) {
        slot_t s = t->slots[i];
        if (s.idx == NIL || (s.fp == fp && key_at(t, s.idx) == key))
            return s.idx;
    }
}

static int table_insert(table_t *t, uint64_t key, int32_t idx)
{
    if ((uint64_t)(t->count + 1) * 2 > t->mask + 1) {
        uint64_t size = (t->mask + 1) * 2;
        slot_t *slots = PyMem_Malloc(sizeof(slot_t) * size);
        if (!slots)
            return -1;
        for (uint64_t i = 0; i < size; i++)
            slots[i].idx = NIL;
        for (uint64_t i = 0; i <= t->mask; i++)
            if (t->slots[i].idx != NIL) {
                uint64_t j = home_of(t, t->slots[i].fp) & (size - 1);
                while (slots[j].idx != NIL)
                    j = (j + 1) & (size - 1);
                slots[j] = t->slots[i];
            }
        PyMem_Free(t->slots);
        t->slots = slots;
        t->mask = size - 1;
    }
    uint32_t fp = fp_of(key);
    uint64_t i = home_of(t, fp) & t->mask;
    while (t->slots[i].idx != NIL)
        i = (i + 1) & t->mask;
    t->slots[i] = (slot_t){fp, idx};
    t->count++;
    return 0;
}

static void table_delete(table_t *t, int32_t idx)
{
    uint64_t mask = t->mask, i = home_of(t, fp_of(key_at(t, idx))) & mask;
    while (t->slots[i].idx != idx)
        i = (i + 1) & mask;
    for (uint64_t j = (i + 1) & mask;; j = (j + 1) & mask) { /* backward shift */
        slot_t *s = &t->slots[j];
        if (s->idx == NIL)
            break;
        if (((j - (home_of(t, s->fp) & mask)) & mask) >= ((j - i) & mask)) {
            t->slots[i] = *s;
            i = j;
        }
    }
    t->slots[i].idx = NIL;
    t->count--;
}

static void table_clear(table_t *t)
{
    for (uint64_t i = 0; i <= t->mask; i++)
        t->slots[i].idx = NIL;
    t->count = 0;
}

/* -- nodes on ordered lists (oldest at the head) ---------------------------------------------- */

typedef struct {
    int32_t head, tail;
    int64_t len;
} list_t;

/* A miniature's key: on one of FRESH, MAIN (held) or GHOST. */
typedef struct {
    uint64_t key;
    int64_t stamp, size;
    int32_t prev, next;
    uint32_t place;
    uint8_t list;
} node_t;

/* A key of the eight weight miniatures: its place on each one's lists, or NONE. */
typedef struct {
    uint64_t key;
    int64_t stamp, size;
    int32_t prev[NWEIGHTS], next[NWEIGHTS];
    uint8_t list[NWEIGHTS];
    int32_t refs; /* the weights whose lists hold it, and pins */
} wnode_t;

/* A pool of nodes of `width` bytes with a free list threaded through `next`. */
typedef struct {
    char *mem;
    int32_t cap, top, free_head;
} pool_t;

static int pool_init(pool_t *p, size_t width)
{
    p->cap = 64;
    p->top = 0;
    p->free_head = NIL;
    p->mem = PyMem_Malloc(width * (size_t)p->cap);
    return p->mem ? 0 : -1;
}

#define NODE(s, n) (((node_t *)(s)->pool.mem)[n])
#define WNODE(j, n) (((wnode_t *)(j)->pool.mem)[n])

/* -- a miniature's store: one table, three lists ---------------------------------------------- */

typedef struct {
    pool_t pool;
    table_t table;
    list_t lists[3];
} store_t;

static int store_init(store_t *s)
{
    memset(s, 0, sizeof(*s));
    if (pool_init(&s->pool, sizeof(node_t)) < 0 ||
        table_init(&s->table, 128, &s->pool.mem, sizeof(node_t)) < 0)
        return -1;
    for (int i = 0; i < 3; i++)
        s->lists[i] = (list_t){NIL, NIL, 0};
    return 0;
}

static void store_free(store_t *s)
{
    PyMem_Free(s->pool.mem);
    PyMem_Free(s->table.slots);
    s->pool.mem = NULL;
    s->table.slots = NULL;
}

static inline void list_append(store_t *s, int32_t n, int32_t list)
{
    list_t *l = &s->lists[list];
    node_t *x = &NODE(s, n);
    x->list = list;
    x->prev = l->tail;
    x->next = NIL;
    if (l->tail != NIL)
        NODE(s, l->tail).next = n;
    else
        l->head = n;
    l->tail = n;
    l->len++;
}

static inline void list_unlink(store_t *s, int32_t n)
{
    node_t *x = &NODE(s, n);
    list_t *l = &s->lists[x->list];
    if (x->prev != NIL)
        NODE(s, x->prev).next = x->next;
    else
        l->head = x->next;
    if (x->next != NIL)
        NODE(s, x->next).prev = x->prev;
    else
        l->tail = x->prev;
    l->len--;
}

static int32_t pool_take(pool_t *p, size_t width, int32_t *next_of_free)
{
    int32_t n = p->free_head;
    if (n != NIL) {
        p->free_head = *next_of_free;
        return n;
    }
    if (p->top == p->cap) {
        if (p->cap > INT32_MAX / 2)
            return NIL;
        char *mem = PyMem_Realloc(p->mem, width * (size_t)p->cap * 2);
        if (!mem)
            return NIL;
        p->mem = mem;
        p->cap *= 2;
    }
    return p->top++;
}

/* A new node at the tail of `list`; NIL when out of memory (the error set). */
static int32_t store_add(store_t *s, uint64_t key, uint32_t place, int32_t list, int64_t stamp,
                         int64_t size)
{
    int32_t head = s->pool.free_head;
    int32_t n = pool_take(&s->pool, sizeof(node_t), head != NIL ? &NODE(s, head).next : NULL);
    if (n == NIL || table_insert(&s->table, key, n) < 0) {
        PyErr_NoMemory();
        return NIL;
    }
    node_t *x = &NODE(s, n);
    x->key = key;
    x->place = place;
    x->stamp = stamp;
    x->size = size;
    list_append(s, n, list);
    return n;
}

static void store_del(store_t *s, int32_t n)
{
    list_unlink(s, n);
    table_delete(&s->table, n);
    NODE(s, n).list = NONE;
    NODE(s, n).next = s->pool.free_head;
    s->pool.free_head = n;
}

static inline void store_move(store_t *s, int32_t n, int32_t list, int64_t stamp)
{
    list_unlink(s, n);
    NODE(s, n).stamp = stamp;
    list_append(s, n, list);
}

/* -- the eight weight miniatures of a `shadow` miniature ------------------------------------- */

typedef struct {
    pool_t pool;
    table_t table;
    list_t lists[NWEIGHTS][3];
    int64_t used[NWEIGHTS];
} joint_t;

static int joint_init(joint_t *j)
{
    memset(j, 0, sizeof(*j));
    if (pool_init(&j->pool, sizeof(wnode_t)) < 0 ||
        table_init(&j->table, 128, &j->pool.mem, sizeof(wnode_t)) < 0)
        return -1;
    for (int w = 0; w < NWEIGHTS; w++)
        for (int i = 0; i < 3; i++)
            j->lists[w][i] = (list_t){NIL, NIL, 0};
    return 0;
}

static void joint_free(joint_t *j)
{
    PyMem_Free(j->pool.mem);
    PyMem_Free(j->table.slots);
    j->pool.mem = NULL;
    j->table.slots = NULL;
}

static void joint_clear(joint_t *j)
{
    table_clear(&j->table);
    j->pool.top = 0;
    j->pool.free_head = NIL;
    for (int w = 0; w < NWEIGHTS; w++) {
        for (int i = 0; i < 3; i++)
            j->lists[w][i] = (list_t){NIL, NIL, 0};
        j->used[w] = 0;
    }
}

static inline void wl_append(joint_t *j, int32_t n, int w, int list)
{
    list_t *l = &j->lists[w][list];
    wnode_t *x = &WNODE(j, n);
    x->list[w] = (uint8_t)list;
    x->prev[w] = l->tail;
    x->next[w] = NIL;
    if (l->tail != NIL)
        WNODE(j, l->tail).next[w] = n;
    else
        l->head = n;
    l->tail = n;
    l->len++;
}

static inline void wl_unlink(joint_t *j, int32_t n, int w)
{
    wnode_t *x = &WNODE(j, n);
    list_t *l = &j->lists[w][x->list[w]];
    if (x->prev[w] != NIL)
        WNODE(j, x->prev[w]).next[w] = x->next[w];
    else
        l->head = x->next[w];
    if (x->next[w] != NIL)
        WNODE(j, x->next[w]).prev[w] = x->prev[w];
    else
        l->tail = x->prev[w];
    l->len--;
}

/* A node on no list of any weight; NIL when out of memory (the error set). */
static int32_t joint_add(joint_t *j, uint64_t key, int64_t stamp, int64_t size)
{
    int32_t head = j->pool.free_head;
    int32_t n = pool_take(&j->pool, sizeof(wnode_t), head != NIL ? &WNODE(j, head).next[0] : NULL);
    if (n == NIL || table_insert(&j->table, key, n) < 0) {
        PyErr_NoMemory();
        return NIL;
    }
    wnode_t *x = &WNODE(j, n);
    x->key = key;
    x->stamp = stamp;
    x->size = size;
    x->refs = 0;
    memset(x->list, NONE, sizeof(x->list));
    return n;
}

static inline void joint_release(joint_t *j, int32_t n)
{
    if (--WNODE(j, n).refs > 0)
        return;
    table_delete(&j->table, n);
    WNODE(j, n).next[0] = j->pool.free_head;
    j->pool.free_head = n;
}

/* -- the miniatures ---------------------------------------------------------------------------- */

typedef struct {
    store_t store; /* lru: MAIN only; shadow: FRESH, MAIN, GHOST */
    int64_t capacity, used;
    /* shadow */
    int64_t tick;
    int weight; /* index into WEIGHT */
    int has_shadows;
    uint64_t threshold; /* the weight miniatures' CRC-32 bound; 0 before the first insert */
    int64_t sampled, period, periods, idle;
    double wcap;
    int64_t ghost_limit, wclock;
    double hits[NWEIGHTS];
    int64_t total[NWEIGHTS];
    joint_t joint;
    int joint_ready;
} mini_t;

typedef struct {
    uint64_t key;
    uint32_t place;
    const uint8_t *bytes;
    Py_ssize_t len;
    int crc_done;
    uint32_t crc;
} ref_t;

static uint32_t crc_table[8][256];

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xff];
}

/* zlib's CRC-32, eight bytes a step (slicing-by-8, little-endian loads) */
static uint32_t crc32_of(const uint8_t *p, Py_ssize_t len)
{
    uint32_t c = 0xFFFFFFFFu;
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    for (; len >= 8; p += 8, len -= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= c;
        c = crc_table[7][lo & 0xff] ^ crc_table[6][(lo >> 8) & 0xff] ^
            crc_table[5][(lo >> 16) & 0xff] ^ crc_table[4][lo >> 24] ^
            crc_table[3][hi & 0xff] ^ crc_table[2][(hi >> 8) & 0xff] ^
            crc_table[1][(hi >> 16) & 0xff] ^ crc_table[0][hi >> 24];
    }
#endif
    for (; len > 0; p++, len--)
        c = crc_table[0][(c ^ *p) & 0xff] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

static uint64_t key_hash(const uint8_t *p, Py_ssize_t len)
{
    uint64_t h = 0x243F6A8885A308D3ull ^ (uint64_t)len;
    Py_ssize_t i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = (h ^ w) * 0xFF51AFD7ED558CCDull;
        h ^= h >> 32;
    }
    uint64_t w = 0;
    memcpy(&w, p + i, (size_t)(len - i));
    h = (h ^ w ^ ((uint64_t)(len - i) << 56)) * 0xC4CEB9FE1A85EC53ull;
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDull;
    return h ^ (h >> 33);
}

static inline uint32_t ref_crc(ref_t *r)
{
    if (!r->crc_done) {
        r->crc = crc32_of(r->bytes, r->len);
        r->crc_done = 1;
    }
    return r->crc;
}

static int mini_init(mini_t *m, int64_t capacity)
{
    memset(m, 0, sizeof(*m));
    m->capacity = capacity;
    return store_init(&m->store);
}

static void mini_free(mini_t *m)
{
    store_free(&m->store);
    if (m->joint_ready)
        joint_free(&m->joint);
}

/* ShadowLRUPolicy._next_victim then Policy.make_room's pop: the victim joins the ghost list,
 * trimmed to GHOST_FACTOR times the blocks held (the victim counted). */
static void shadow_evict_one(mini_t *m)
{
    store_t *s = &m->store;
    list_t *fresh = &s->lists[FRESH], *main_ = &s->lists[MAIN];
    int32_t victim;
    if (fresh->len && (!main_->len || (double)(m->tick - NODE(s, fresh->head).stamp) *
                                              WEIGHT[m->weight] >=
                                          (double)(m->tick - NODE(s, main_->head).stamp)))
        victim = fresh->head;
    else
        victim = main_->head;
    int64_t held = fresh->len + main_->len;
    m->used -= NODE(s, victim).size;
    list_unlink(s, victim);
    list_append(s, victim, GHOST);
    int64_t limit = GHOST_FACTOR * held > 16 ? GHOST_FACTOR * held : 16;
    while (s->lists[GHOST].len > limit)
        store_del(s, s->lists[GHOST].head);
}

static void lru_evict_one(mini_t *m)
{
    store_t *s = &m->store;
    int32_t victim = s->lists[MAIN].head;
    m->used -= NODE(s, victim).size;
    store_del(s, victim);
}

static inline int64_t mini_held(const mini_t *m, int shadow)
{
    const store_t *s = &m->store;
    return shadow ? s->lists[FRESH].len + s->lists[MAIN].len : s->lists[MAIN].len;
}

/* Policy.make_room: the victims' count, or -1 when `needed` exceeds the capacity. */
static int64_t mini_make_room(mini_t *m, int shadow, int64_t needed)
{
    if (m->capacity - m->used >= needed)
        return 0;
    if (needed > m->capacity)
        return -1;
    int64_t victims = 0;
    while (m->capacity - m->used < needed && mini_held(m, shadow)) {
        if (shadow)
            shadow_evict_one(m);
        else
            lru_evict_one(m);
        victims++;
    }
    return victims;
}

/* ShadowLRUPolicy._start_shadows */
static int start_shadows(mini_t *m, int64_t size)
{
    if (size <= 0)
        return 0;
    int64_t blocks = m->capacity / size;
    if (blocks < 1)
        blocks = 1;
    double rate = SAMPLE_BLOCKS / (double)blocks;
    if (rate > 1.0)
        rate = 1.0;
    m->threshold = (uint64_t)(rate * 4294967296.0);
    double mini = (double)m->capacity * rate;
    int64_t ghosts = (int64_t)(GHOST_FACTOR * mini / (double)size);
    m->ghost_limit = ghosts > 16 ? ghosts : 16;
    m->wcap = mini;
    int64_t period = (int64_t)(mini / (double)size);
    m->period = period > 8 ? period : 8;
    m->wclock = 0;
    for (int i = 0; i < NWEIGHTS; i++) {
        m->hits[i] = 0.0;
        m->total[i] = 0;
    }
    if (!m->joint_ready) {
        if (joint_init(&m->joint) < 0) {
            PyErr_NoMemory();
            return -1;
        }
        m->joint_ready = 1;
    } else {
        joint_clear(&m->joint);
    }
    m->has_shadows = 1;
    return 0;
}

/* _WeightCaches.access: one reference to every weight's miniature. */
static int weights_access(mini_t *m, const ref_t *r, int64_t size)
{
    joint_t *j = &m->joint;
    int64_t clock = ++m->wclock;
    int32_t n = table_find(&j->table, r->key);
    if (n == NIL && (n = joint_add(j, r->key, clock, size)) == NIL)
        return -1;
    WNODE(j, n).refs++; /* pinned: a weight's ghost trim must not free it */
    int admitted = 0;
    for (int w = 0; w < NWEIGHTS; w++) {
        int at = WNODE(j, n).list[w];
        if (at == FRESH || at == MAIN) {
            m->hits[w] += 1.0;
            m->total[w] += 1;
            wl_unlink(j, n, w);
            wl_append(j, n, w, MAIN);
            continue;
        }
        int64_t used = j->used[w] + size;
        list_t *fresh = &j->lists[w][FRESH], *main_ = &j->lists[w][MAIN];
        list_t *ghost = &j->lists[w][GHOST];
        while ((double)used > m->wcap && (fresh->len || main_->len)) {
            int32_t victim;
            if (!main_->len)
                victim = fresh->head;
            else if (!fresh->len)
                victim = main_->head;
            else if ((double)(clock - WNODE(j, fresh->head).stamp) * WEIGHT[w] >=
                     (double)(clock - WNODE(j, main_->head).stamp))
                victim = fresh->head;
            else
                victim = main_->head;
            used -= WNODE(j, victim).size;
            wl_unlink(j, victim, w);
            wl_append(j, victim, w, GHOST);
            if (ghost->len > m->ghost_limit) {
                int32_t old = ghost->head;
                wl_unlink(j, old, w);
                WNODE(j, old).list[w] = NONE;
                joint_release(j, old);
            }
        }
        j->used[w] = used;
        admitted = 1;
        if (WNODE(j, n).list[w] == GHOST) { /* its ghost entry may have just been trimmed */
            wl_unlink(j, n, w);
            wl_append(j, n, w, MAIN);
        } else {
            WNODE(j, n).refs++;
            wl_append(j, n, w, FRESH);
        }
    }
    WNODE(j, n).stamp = clock;
    if (admitted)
        WNODE(j, n).size = size;
    joint_release(j, n); /* the pin */
    return 0;
}

/* ShadowLRUPolicy._sample: the weight miniatures' step, and each period the weight chosen. */
static int shadow_sample_base(mini_t *m, ref_t *r, int64_t size)
{
    if (!m->has_shadows || ref_crc(r) >= m->threshold)
        return 0;
    if (weights_access(m, r, size) < 0)
        return -1;
    if (++m->sampled < m->period)
        return 0;
    m->sampled = 0;
    int best = 0;
    for (int i = 1; i < NWEIGHTS; i++) {
        /* the most hits; among equals the weight nearest the current one, then the first */
        int di = abs(i - m->weight), db = abs(best - m->weight);
        if (m->hits[i] > m->hits[best] || (m->hits[i] == m->hits[best] && di < db))
            best = i;
    }
    if (m->total[best] < m->total[0])
        best = 0;
    m->weight = best;
    for (int i = 0; i < NWEIGHTS; i++)
        m->hits[i] *= DECAY;
    return 0;
}

/* _MiniatureShadow._restart: every weight miniature takes this cache's state. */
static int shadow_restart(mini_t *m)
{
    joint_t *j = &m->joint;
    store_t *s = &m->store;
    joint_clear(j);
    int64_t skip = s->lists[GHOST].len - m->ghost_limit; /* the ghosts they keep: the last */
    for (int list = FRESH; list <= GHOST; list++)
        for (int32_t n = s->lists[list].head; n != NIL; n = NODE(s, n).next) {
            if (list == GHOST && skip-- > 0)
                continue;
            int32_t x = joint_add(j, NODE(s, n).key, NODE(s, n).stamp, NODE(s, n).size);
            if (x == NIL)
                return -1;
            WNODE(j, x).refs = NWEIGHTS;
            for (int w = 0; w < NWEIGHTS; w++)
                wl_append(j, x, w, list);
        }
    for (int w = 0; w < NWEIGHTS; w++)
        j->used[w] = m->used;
    m->wclock = m->tick;
    m->sampled = 0;
    return 0;
}

/* _MiniatureShadow._sample */
static int shadow_sample(mini_t *m, ref_t *r, int64_t size)
{
    if (!m->has_shadows || m->threshold < SPACE)
        return shadow_sample_base(m, r, size);
    if (m->periods < ACTIVE) {
        int64_t before = m->sampled;
        if (shadow_sample_base(m, r, size) < 0)
            return -1;
        if (m->sampled < before && ++m->periods >= CYCLE)
            m->periods = 0;
        return 0;
    }
    if (++m->idle < m->period)
        return 0;
    m->idle = 0;
    if (++m->periods >= CYCLE) {
        m->periods = 0;
        return shadow_restart(m);
    }
    return 0;
}

/* One sampled reference: 1 a hit, 0 a miss, -1 an error; *delta the change in keys held. */
static int mini_access(mini_t *m, int shadow, ref_t *r, int64_t size, int64_t *delta)
{
    store_t *s = &m->store;
    int32_t n = table_find(&s->table, r->key);
    if (n != NIL && NODE(s, n).list != GHOST) {
        if (!shadow) {
            store_move(s, n, MAIN, 0);
            return 1;
        }
        m->tick++;
        store_move(s, n, MAIN, m->tick);
        return shadow_sample(m, r, NODE(s, n).size) < 0 ? -1 : 1;
    }
    int64_t victims = mini_make_room(m, shadow, size);
    if (victims < 0)
        return 0; /* larger than the miniature: a miss, not kept */
    *delta += 1 - victims;
    m->used += size;
    if (!shadow)
        return store_add(s, r->key, r->place, MAIN, 0, size) == NIL ? -1 : 0;
    if (!m->has_shadows && m->threshold == 0 && start_shadows(m, size) < 0)
        return -1;
    m->tick++;
    n = table_find(&s->table, r->key);
    if (n != NIL) { /* a ghost comes back to main */
        NODE(s, n).size = size;
        store_move(s, n, MAIN, m->tick);
    } else if (store_add(s, r->key, r->place, FRESH, m->tick, size) == NIL) {
        return -1;
    }
    return shadow_sample(m, r, size) < 0 ? -1 : 0;
}

static int64_t mini_remove(mini_t *m, int shadow, uint64_t key)
{
    store_t *s = &m->store;
    int32_t n = table_find(&s->table, key);
    if (n == NIL || NODE(s, n).list == GHOST)
        return 0;
    m->used -= NODE(s, n).size;
    store_del(s, n);
    return 1;
}

/* Policy.resize (and ShadowLRUPolicy's, _MiniatureShadow's): the weight miniatures start
 * again at the next insert. */
static void mini_resize(mini_t *m, int shadow, int64_t capacity)
{
    if (shadow) {
        m->periods = m->idle = 0;
        m->has_shadows = 0;
        m->threshold = 0;
        m->sampled = 0;
    }
    m->capacity = capacity;
    mini_make_room(m, shadow, 0);
}

/* -- the front: the sample test and the hot keys (_mrc._PyFront) ------------------------------ */

typedef struct {
    uint64_t key;
    int64_t count;
    int64_t order; /* insertion order: a stable sort's tie-break */
} tally_t;

typedef struct {
    PyObject_HEAD
    int shadow;
    Py_ssize_t n;
    mini_t *minis;
    uint64_t *thresholds;
    int64_t *hits, *sampled;
    int64_t held, max_keys;
    PyObject *events; /* events(code, size): 0 size the rates, 1 lower them, 2 the hot keys
                         changed (the miniatures' room) */
    uint64_t top;     /* keys whose place is below reach some miniature */
    int sized;
    int64_t accesses, hot_refs, hot_hits, top_sampled, sampled_bytes, review_at;
    tally_t hot[MAX_HOT];
    int nhot;
    char *cand_mem; /* tally_t: first keys this window, in order */
    int32_t ncand, cand_cap;
    table_t cand_index; /* key -> index into candidates */
} Curve;

static inline int hot_find(const Curve *c, uint64_t key)
{
    for (int i = 0; i < c->nhot; i++)
        if (c->hot[i].key == key)
            return i;
    return -1;
}

static int curve_event(Curve *c, int code, int64_t size)
{
    PyObject *out = PyObject_CallFunction(c->events, "iL", code, (long long)size);
    if (!out)
        return -1;
    Py_DECREF(out);
    return 0;
}

static int tally_cmp(const void *a, const void *b)
{
    const tally_t *x = a, *y = b;
    if (x->count != y->count)
        return x->count > y->count ? -1 : 1;
    return x->order < y->order ? -1 : x->order > y->order;
}

/* _PyFront._review */
static int curve_review(Curve *c)
{
    c->review_at = c->accesses + HOT_WINDOW;
    double keep = HOT_SHARE * HOT_WINDOW;
    uint64_t before[MAX_HOT];
    int nbefore = c->nhot, kept = 0;
    for (int i = 0; i < c->nhot; i++) {
        before[i] = c->hot[i].key;
        if (c->hot[i].count > 0)
            c->hot[kept++] = (tally_t){c->hot[i].key, 0, 0};
    }
    c->nhot = kept;
    tally_t *cand = (tally_t *)c->cand_mem;
    qsort(cand, (size_t)c->ncand, sizeof(tally_t), tally_cmp);
    for (int32_t i = 0; i < c->ncand; i++) {
        if ((double)cand[i].count < keep || c->nhot >= MAX_HOT)
            break;
        uint64_t key = cand[i].key;
        c->hot[c->nhot++] = (tally_t){key, 0, 0};
        for (Py_ssize_t k = 0; k < c->n; k++)
            c->held -= mini_remove(&c->minis[k], c->shadow, key);
    }
    c->ncand = 0;
    table_clear(&c->cand_index);
    int changed = c->nhot != nbefore;
    for (int i = 0; !changed && i < c->nhot; i++) {
        changed = 1;
        for (int k = 0; k < nbefore; k++)
            if (before[k] == c->hot[i].key) {
                changed = 0;
                break;
            }
    }
    return changed && c->sized ? curve_event(c, 2, 0) : 0;
}

/* _PyFront._first: a chain's head, a candidate hot key. */
static int curve_first(Curve *c, uint64_t key)
{
    if (hot_find(c, key) < 0) {
        int32_t at = table_find(&c->cand_index, key);
        if (at != NIL) {
            ((tally_t *)c->cand_mem)[at].count++;
        } else {
            if (c->ncand == c->cand_cap) {
                if (c->cand_cap > INT32_MAX / 4) {
                    PyErr_NoMemory();
                    return -1;
                }
                int32_t cap = c->cand_cap ? 2 * c->cand_cap : 256;
                char *more = PyMem_Realloc(c->cand_mem, sizeof(tally_t) * (size_t)cap);
                if (!more) {
                    PyErr_NoMemory();
                    return -1;
                }
                c->cand_mem = more;
                c->cand_cap = cap;
            }
            ((tally_t *)c->cand_mem)[c->ncand] = (tally_t){key, 1, c->ncand};
            if (table_insert(&c->cand_index, key, c->ncand) < 0) {
                PyErr_NoMemory();
                return -1;
            }
            c->ncand++;
        }
    }
    return c->accesses >= c->review_at ? curve_review(c) : 0;
}

static inline int curve_hot(Curve *c, uint64_t key)
{
    int h = hot_find(c, key);
    if (h < 0)
        return 0;
    c->hot[h].count++;
    c->hot_refs++;
    c->hot_hits++;
    return 1;
}

/* _PyFront._sampled: a key under the top threshold. */
static int curve_sampled(Curve *c, ref_t *r, int64_t size)
{
    if (curve_hot(c, r->key))
        return 0;
    if (!c->sized) {
        c->sized = 1;
        if (curve_event(c, 0, size) < 0)
            return -1;
        if (r->place >= c->top)
            return 0;
    }
    c->top_sampled++;
    c->sampled_bytes += size;
    /* The miniatures' tables are apart in memory: ask for every slot the key's probe starts
     * at (and each list's oldest node, a miss's victim) at once, so the misses overlap. */
    uint32_t fp = fp_of(r->key);
    for (Py_ssize_t i = 0; i < c->n && r->place < c->thresholds[i]; i++) {
        store_t *s = &c->minis[i].store;
        __builtin_prefetch(&s->table.slots[home_of(&s->table, fp) & s->table.mask]);
        for (int list = FRESH; list <= GHOST; list++)
            if (s->lists[list].head != NIL)
                __builtin_prefetch(&NODE(s, s->lists[list].head));
    }
    int64_t delta = 0;
    for (Py_ssize_t i = 0; i < c->n; i++) {
        if (r->place >= c->thresholds[i])
            continue;
        c->sampled[i]++;
        int hit = mini_access(&c->minis[i], c->shadow, r, size, &delta);
        if (hit < 0) {
            c->held += delta;
            return -1;
        }
        c->hits[i] += hit;
    }
    c->held += delta;
    return c->held > c->max_keys ? curve_event(c, 1, 0) : 0;
}

static int parse_key(PyObject *obj, ref_t *r)
{
    if (!PyBytes_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, "key must be bytes");
        return -1;
    }
    r->bytes = (const uint8_t *)PyBytes_AS_STRING(obj);
    r->len = PyBytes_GET_SIZE(obj);
    r->key = key_hash(r->bytes, r->len);
    uint8_t head[4] = {0, 0, 0, 0};
    memcpy(head, r->bytes, (size_t)(r->len < 4 ? r->len : 4));
    r->place = (uint32_t)head[0] << 24 | (uint32_t)head[1] << 16 | (uint32_t)head[2] << 8 | head[3];
    r->crc_done = 0;
    return 0;
}

static int curve_reference(Curve *c, ref_t *r, int64_t size)
{
    if (r->place < c->top)
        return curve_sampled(c, r, size);
    curve_hot(c, r->key);
    return 0;
}

static PyObject *Curve_access(Curve *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "access(key, size=1, first=False)");
        return NULL;
    }
    long long size = 1;
    if (nargs > 1 && (size = PyLong_AsLongLong(args[1])) == -1 && PyErr_Occurred())
        return NULL;
    int first = 0;
    if (nargs > 2 && (first = PyObject_IsTrue(args[2])) < 0)
        return NULL;
    ref_t r;
    if (parse_key(args[0], &r) < 0)
        return NULL;
    self->accesses++;
    if (first && curve_first(self, r.key) < 0)
        return NULL;
    if (curve_reference(self, &r, size) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Curve_access_many(Curve *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "access_many(keys, size=1)");
        return NULL;
    }
    long long size = 1;
    if (nargs > 1 && (size = PyLong_AsLongLong(args[1])) == -1 && PyErr_Occurred())
        return NULL;
    PyObject *fast = PySequence_Fast(args[0], "keys must be a sequence of bytes");
    if (!fast)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    if (count) {
        self->accesses += count;
        ref_t r;
        if (parse_key(items[0], &r) < 0 || curve_first(self, r.key) < 0 ||
            curve_reference(self, &r, size) < 0)
            goto fail;
        for (Py_ssize_t i = 1; i < count; i++)
            if (parse_key(items[i], &r) < 0 || curve_reference(self, &r, size) < 0)
                goto fail;
    }
    Py_DECREF(fast);
    Py_RETURN_NONE;
fail:
    Py_DECREF(fast);
    return NULL;
}

static int64_t *int64_list(PyObject *seq, Py_ssize_t n, const char *what)
{
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast)
        return NULL;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd values", what, n);
        Py_DECREF(fast);
        return NULL;
    }
    int64_t *out = PyMem_Malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
    if (!out) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) {
            PyMem_Free(out);
            Py_DECREF(fast);
            return NULL;
        }
        out[i] = v;
    }
    Py_DECREF(fast);
    return out;
}

static PyObject *Curve_configure(Curve *self, PyObject *args)
{
    PyObject *thresholds, *capacities;
    if (!PyArg_ParseTuple(args, "OO", &thresholds, &capacities))
        return NULL;
    int64_t *thr = int64_list(thresholds, self->n, "thresholds");
    if (!thr)
        return NULL;
    int64_t *caps = int64_list(capacities, self->n, "capacities");
    if (!caps) {
        PyMem_Free(thr);
        return NULL;
    }
    int64_t held = 0;
    uint64_t top = 0;
    for (Py_ssize_t i = 0; i < self->n; i++) {
        mini_t *m = &self->minis[i];
        uint64_t bound = thr[i] < 0 ? 0 : (uint64_t)thr[i];
        self->thresholds[i] = bound;
        top = bound > top ? bound : top;
        store_t *s = &m->store;
        for (int list = FRESH; list <= MAIN; list++) /* keys at or above it leave */
            for (int32_t n = s->lists[list].head, next; n != NIL; n = next) {
                next = NODE(s, n).next;
                if (NODE(s, n).place >= bound) {
                    m->used -= NODE(s, n).size;
                    store_del(s, n);
                }
            }
        mini_resize(m, self->shadow, caps[i]);
        held += mini_held(m, self->shadow);
    }
    self->held = held;
    self->top = top;
    PyMem_Free(thr);
    PyMem_Free(caps);
    return PyLong_FromLongLong(held);
}

static PyObject *int64_list_of(const int64_t *v, Py_ssize_t n)
{
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *x = PyLong_FromLongLong(v[i]);
        if (!x) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, x);
    }
    return out;
}

static PyObject *Curve_lengths(Curve *self, PyObject *unused)
{
    int64_t *v = PyMem_Malloc(sizeof(int64_t) * (size_t)(self->n ? self->n : 1));
    if (!v)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < self->n; i++)
        v[i] = mini_held(&self->minis[i], self->shadow);
    PyObject *out = int64_list_of(v, self->n);
    PyMem_Free(v);
    return out;
}

static PyObject *Curve_weights(Curve *self, PyObject *unused)
{
    PyObject *out = PyList_New(self->n);
    for (Py_ssize_t i = 0; out && i < self->n; i++) {
        PyObject *x = PyFloat_FromDouble(self->shadow ? WEIGHT[self->minis[i].weight] : 1.0);
        if (!x) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, x);
    }
    return out;
}

static PyObject *Curve_hits(Curve *self, void *closure) { return int64_list_of(self->hits, self->n); }

static PyObject *Curve_sampled(Curve *self, void *closure)
{
    return int64_list_of(self->sampled, self->n);
}

#define INT64_GETTER(name)                                                                       \
    static PyObject *Curve_get_##name(Curve *self, void *closure)                                \
    {                                                                                            \
        return PyLong_FromLongLong(self->name);                                                  \
    }
INT64_GETTER(held)
INT64_GETTER(accesses)
INT64_GETTER(hot_refs)
INT64_GETTER(hot_hits)
INT64_GETTER(top_sampled)
INT64_GETTER(sampled_bytes)

static PyObject *Curve_get_hot_count(Curve *self, void *closure)
{
    return PyLong_FromLong(self->nhot);
}

static PyObject *Curve_get_sized(Curve *self, void *closure) { return PyBool_FromLong(self->sized); }

static int Curve_traverse(Curve *self, visitproc visit, void *arg)
{
    Py_VISIT(self->events);
    return 0;
}

static int Curve_clear(Curve *self)
{
    Py_CLEAR(self->events);
    return 0;
}

static void Curve_dealloc(Curve *self)
{
    PyObject_GC_UnTrack(self);
    Curve_clear(self);
    if (self->minis)
        for (Py_ssize_t i = 0; i < self->n; i++)
            mini_free(&self->minis[i]);
    PyMem_Free(self->minis);
    PyMem_Free(self->thresholds);
    PyMem_Free(self->hits);
    PyMem_Free(self->sampled);
    PyMem_Free(self->cand_mem);
    PyMem_Free(self->cand_index.slots);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Curve_init(Curve *self, PyObject *args, PyObject *kwds)
{
    const char *policy;
    PyObject *capacities, *events;
    long long max_keys;
    static char *kwlist[] = {"policy", "capacities", "max_keys", "events", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "sOLO", kwlist, &policy, &capacities,
                                     &max_keys, &events))
        return -1;
    if (self->minis) {
        PyErr_SetString(PyExc_RuntimeError, "Curve is initialized once");
        return -1;
    }
    if (!PyCallable_Check(events)) {
        PyErr_SetString(PyExc_TypeError, "events must be callable");
        return -1;
    }
    if (strcmp(policy, "lru") == 0)
        self->shadow = 0;
    else if (strcmp(policy, "shadow") == 0)
        self->shadow = 1;
    else {
        PyErr_Format(PyExc_ValueError, "native miniatures run lru or shadow, not %s", policy);
        return -1;
    }
    Py_ssize_t n = PySequence_Size(capacities);
    if (n < 0)
        return -1;
    int64_t *caps = int64_list(capacities, n, "capacities");
    if (!caps)
        return -1;
    size_t cells = (size_t)(n ? n : 1);
    self->minis = PyMem_Calloc(cells, sizeof(mini_t));
    self->thresholds = PyMem_Malloc(sizeof(uint64_t) * cells);
    self->hits = PyMem_Calloc(cells, sizeof(int64_t));
    self->sampled = PyMem_Calloc(cells, sizeof(int64_t));
    if (!self->minis || !self->thresholds || !self->hits || !self->sampled ||
        table_init(&self->cand_index, 256, &self->cand_mem, sizeof(tally_t)) < 0) {
        PyMem_Free(caps);
        PyErr_NoMemory();
        return -1;
    }
    Py_INCREF(events);
    self->events = events;
    self->max_keys = max_keys;
    self->top = SPACE; /* every key takes the sampled path until the rates are sized */
    self->review_at = HOT_WINDOW;
    self->n = n;
    for (Py_ssize_t i = 0; i < n; i++) {
        self->thresholds[i] = SPACE;
        if (mini_init(&self->minis[i], caps[i]) < 0) {
            self->n = i + 1;
            PyMem_Free(caps);
            PyErr_NoMemory();
            return -1;
        }
    }
    PyMem_Free(caps);
    return 0;
}

static PyMethodDef Curve_methods[] = {
    {"access", (PyCFunction)(void (*)(void))Curve_access, METH_FASTCALL,
     "access(key, size=1, first=False): one reference (first: its batch's first key)."},
    {"access_many", (PyCFunction)(void (*)(void))Curve_access_many, METH_FASTCALL,
     "access_many(keys, size=1): a batch's references, in order."},
    {"configure", (PyCFunction)Curve_configure, METH_VARARGS,
     "configure(thresholds, capacities) -> keys held: each miniature's sample threshold "
     "(keys at or above it leave) and capacity (victims evicted to fit)."},
    {"lengths", (PyCFunction)Curve_lengths, METH_NOARGS, "the keys each miniature holds"},
    {"weights", (PyCFunction)Curve_weights, METH_NOARGS,
     "each miniature's fresh-segment weight (shadow; 1.0 under lru)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Curve_getset[] = {
    {"hits", (getter)Curve_hits, NULL, "each miniature's hits", NULL},
    {"sampled", (getter)Curve_sampled, NULL, "each miniature's sampled references", NULL},
    {"held", (getter)Curve_get_held, NULL, "keys held by all the miniatures", NULL},
    {"accesses", (getter)Curve_get_accesses, NULL, "references offered", NULL},
    {"hot_refs", (getter)Curve_get_hot_refs, NULL, "references of hot keys", NULL},
    {"hot_hits", (getter)Curve_get_hot_hits, NULL, "hits of hot keys", NULL},
    {"top_sampled", (getter)Curve_get_top_sampled, NULL, "references under the top", NULL},
    {"sampled_bytes", (getter)Curve_get_sampled_bytes, NULL, "their bytes", NULL},
    {"hot_count", (getter)Curve_get_hot_count, NULL, "hot keys", NULL},
    {"sized", (getter)Curve_get_sized, NULL, "whether the rates were sized", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CurveType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ucm._mrcsim.Curve",
    .tp_basicsize = sizeof(Curve),
    .tp_dealloc = (destructor)Curve_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Curve(policy, capacities, max_keys, events): the front and the miniature "
              "caches of a miss-ratio curve (ucm/kernel/_mrc.py).",
    .tp_traverse = (traverseproc)Curve_traverse,
    .tp_clear = (inquiry)Curve_clear,
    .tp_methods = Curve_methods,
    .tp_getset = Curve_getset,
    .tp_init = (initproc)Curve_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ucm._mrcsim", "The live miss-ratio curve's front and miniatures.", -1,
    NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__mrcsim(void)
{
    crc_init();
    if (PyType_Ready(&CurveType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&CurveType);
    if (PyModule_AddObject(m, "Curve", (PyObject *)&CurveType) < 0) {
        Py_DECREF(&CurveType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
