# Included by _core.pyx: T_OBJECT_EX member descriptors for KVCacheBlock.block_id / ref_cnt / is_null.

# --------------------------------------------------------------------------------------
# T_OBJECT_EX member descriptors for KVCacheBlock.block_id / ref_cnt / is_null
# --------------------------------------------------------------------------------------
cdef PyMemberDef _block_members[3]


cdef _install_member_descriptors():
    cdef KVCacheBlock probe = KVCacheBlock.__new__(KVCacheBlock)
    cdef char* base = <char*><PyObject*>probe
    cdef _TypeObject* tp = <_TypeObject*>KVCacheBlock
    cdef int i
    _block_members[0].name = b"block_id"
    _block_members[0].offset = <char*>&probe._block_id_o - base
    _block_members[1].name = b"ref_cnt"
    _block_members[1].offset = <char*>&probe._ref_cnt_o - base
    _block_members[2].name = b"is_null"
    _block_members[2].offset = <char*>&probe._is_null_o - base
    for i in range(3):
        _block_members[i].type = T_OBJECT_EX
        _block_members[i].flags = 0
        _block_members[i].doc = NULL
        descr = PyDescr_NewMember(tp, &_block_members[i])
        (<dict>tp.tp_dict)[(<bytes>_block_members[i].name).decode()] = descr
    PyType_Modified(tp)


_install_member_descriptors()
