"""streamsched.grammar"""
