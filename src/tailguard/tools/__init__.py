"""tailguard.tools"""
