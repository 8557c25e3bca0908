/* kvconnect._native.KeyTable (keytable.c), registered by the module's init in native.c. */
#ifndef KVCONNECT_KEYTABLE_H
#define KVCONNECT_KEYTABLE_H

#include <Python.h>

/* Add the KeyTable type to `module`; -1 with an exception set on failure. */
int keytable_register(PyObject *module);

#endif
