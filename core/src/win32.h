// <windows.h> as core includes it (Windows builds only): lean, and without the min/max macros
// that would break std::min and std::max. MinGW's libstdc++ may define NOMINMAX already.
#pragma once

#ifdef _WIN32
#ifndef WIN32_LEAN_AND_MEAN
#define WIN32_LEAN_AND_MEAN
#endif
#ifndef NOMINMAX
#define NOMINMAX
#endif
#include <windows.h>
#endif
