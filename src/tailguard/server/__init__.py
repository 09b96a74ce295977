"""tailguard.server"""
