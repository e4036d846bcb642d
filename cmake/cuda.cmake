# The CUDA backend (issue 6): every core/booster/**/*.cu goes into booster_core, compiled for Hopper
# (sm_90) with a compute_90 PTX fallback that newer GPUs JIT-compile. Included by CMakeLists.txt when
# BOOSTER_CUDA is ON, or AUTO and nvcc was found. nvcc is looked up on PATH and at
# /usr/local/cuda/bin/nvcc, where Debian's and NVIDIA's installers put it.
#
# Defines BOOSTER_WITH_CUDA=1 (PUBLIC: tests and programs see it too) and links (privately) cudart, cublas,
# cublasLt, and NCCL when its header and library are found (BOOSTER_WITH_NCCL=1).
if(NOT CMAKE_CUDA_COMPILER)
  find_program(BOOSTER_NVCC nvcc HINTS /usr/local/cuda/bin ENV CUDA_HOME PATH_SUFFIXES bin)
  if(BOOSTER_NVCC)
    set(CMAKE_CUDA_COMPILER ${BOOSTER_NVCC})
  endif()
endif()
if(NOT CMAKE_CUDA_COMPILER)
  if(BOOSTER_CUDA STREQUAL "ON")
    message(FATAL_ERROR "BOOSTER_CUDA=ON but nvcc was found neither on PATH nor at /usr/local/cuda/bin")
  endif()
  message(STATUS "CUDA: nvcc not found, building without the CUDA backend")
  return()
endif()

# sm_90 machine code plus compute_90 PTX (90-real;90-virtual = -gencode arch=compute_90,code=[sm_90,
# compute_90]). Set before enable_language so CMake's compiler check uses it too.
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES 90-real 90-virtual)
endif()
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
# CMake 3.25 does not know nvcc's C++20 flag; teach it, so the core's CXX_STANDARD 20 applies to .cu too.
if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
endif()
set(CMAKE_CUDA_STANDARD 20)

file(GLOB_RECURSE BOOSTER_CUDA_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/core/booster/*.cu)
target_sources(booster_core PRIVATE ${BOOSTER_CUDA_SOURCES})
set_target_properties(booster_core PROPERTIES CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}")
if(CMAKE_CXX_COMPILER_LAUNCHER)  # ccache for nvcc too, when the build uses it for C++
  set_target_properties(booster_core PROPERTIES CUDA_COMPILER_LAUNCHER "${CMAKE_CXX_COMPILER_LAUNCHER}")
endif()
target_compile_options(booster_core PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr --extended-lambda -Xcompiler=-fPIC -Xcudafe=--diag_suppress=esa_on_defaulted_function_ignored>)
target_compile_definitions(booster_core PUBLIC BOOSTER_WITH_CUDA=1)
target_link_libraries(booster_core PRIVATE CUDA::cudart CUDA::cublas CUDA::cublasLt)

# NCCL: the CUDA 13 toolkit image has it beside cudart; a pip wheel (nvidia-nccl-cu13) can be named
# with BOOSTER_NCCL_INCLUDE_DIR / BOOSTER_NCCL_LIBRARY.
find_path(BOOSTER_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/include)
find_library(BOOSTER_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/lib/${CMAKE_LIBRARY_ARCHITECTURE})
if(BOOSTER_NCCL_INCLUDE_DIR AND BOOSTER_NCCL_LIBRARY)
  target_include_directories(booster_core PRIVATE ${BOOSTER_NCCL_INCLUDE_DIR})
  target_link_libraries(booster_core PRIVATE ${BOOSTER_NCCL_LIBRARY})
  target_compile_definitions(booster_core PUBLIC BOOSTER_WITH_NCCL=1)
  message(STATUS "CUDA: ${CMAKE_CUDA_COMPILER} (${CUDAToolkit_VERSION}), NCCL ${BOOSTER_NCCL_LIBRARY}")
else()
  message(STATUS "CUDA: ${CMAKE_CUDA_COMPILER} (${CUDAToolkit_VERSION}), NCCL not found")
endif()
set(BOOSTER_WITH_CUDA ON)
