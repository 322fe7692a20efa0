"""streamsched.dsl"""
