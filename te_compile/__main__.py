from . import doctor

print(doctor())
