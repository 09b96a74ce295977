"""tailguard.tools.load"""
