"""tailguard.deploy"""
