"""eqx_lowmem.memory"""
