"""eqx_lowmem.train"""
