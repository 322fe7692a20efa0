"""streamsched.interp"""
