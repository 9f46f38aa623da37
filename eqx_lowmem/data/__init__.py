"""eqx_lowmem.data"""
