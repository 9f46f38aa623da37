"""eqx_lowmem.precision"""
