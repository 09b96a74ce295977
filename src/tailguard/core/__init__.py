"""tailguard.core"""
