"""eqx_lowmem.nn"""
