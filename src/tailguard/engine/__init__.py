"""tailguard.engine"""
