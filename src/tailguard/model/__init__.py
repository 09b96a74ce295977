"""tailguard.model"""
