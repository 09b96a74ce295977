"""tailguard.tools.batch"""
