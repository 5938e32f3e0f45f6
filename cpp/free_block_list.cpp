// FreeBlockList is header-only (inline, see free_block_list.h) so the Cython
// per-block loops can inline it; this unit checks that the header compiles alone.
#include "free_block_list.h"
